//! Sessions into running instances waiting for their agent: the server
//! cannot reach an agent (agents long-poll their sync), so a tenant's
//! WebSocket for an exec, a shell or a port-forward (or one channel of an
//! SSH connection, see [`crate::ssh`]) is recorded here, the node's held
//! sync is woken and lists it, and the agent dials the session back on a
//! WebSocket of its own, which is handed to the tenant's side to be
//! spliced with it (or bridged to the SSH channel).
//!
//! In memory, on the replica the tenant reached: the agent's sync and its
//! dial-back must reach the same replica (they do with one server, and
//! with replicas behind one address that keeps an agent's connections on
//! one of them). A session nobody dialled within [`DIAL_TIMEOUT`] is
//! dropped and the tenant told so.

use std::collections::HashMap;
use std::sync::Mutex;
use std::time::Duration;

use axum::extract::ws::{Message, WebSocket};
use flotilla_core::access::{AccessKind, AccessSession};
use flotilla_core::id::{AccessSessionId, InstanceId, NodeId};
use flotilla_core::instance::InstanceState;
use futures::{SinkExt as _, StreamExt as _};
use tokio::sync::oneshot;

/// How long a session waits for its agent to dial back: a sync held
/// elsewhere answers within a heartbeat, and a loaded agent needs a moment
/// more.
pub const DIAL_TIMEOUT: Duration = Duration::from_secs(30);

struct Pending {
    node: NodeId,
    session: AccessSession,
    agent: oneshot::Sender<WebSocket>,
}

/// The sessions of this replica still waiting for their agent.
#[derive(Default)]
pub struct Sessions {
    pending: Mutex<HashMap<AccessSessionId, Pending>>,
}

impl Sessions {
    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<AccessSessionId, Pending>> {
        // A panic while holding the map left it whole (every change is
        // one insert or remove).
        self.pending
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// Records `session` for `node`'s agent; the receiver gets the agent's
    /// WebSocket once it dialled back (see [`Sessions::enter`]).
    fn open(&self, node: NodeId, session: AccessSession) -> oneshot::Receiver<WebSocket> {
        let (tx, rx) = oneshot::channel();
        self.lock().insert(
            session.id.clone(),
            Pending {
                node,
                session,
                agent: tx,
            },
        );
        rx
    }

    /// Opens a session of `kind` into `instance` on `node`: records it
    /// (its id from `ids`, as `AppState::ids` gives them), calls `wake` so
    /// that the node's held sync lists it, and returns what waits for the
    /// agent's dial-back. The one way in for every kind of caller (the
    /// exec and port-forward WebSockets, each channel of an SSH
    /// connection), so that all of them are handed to agents alike.
    pub fn enter(
        &self,
        node: NodeId,
        instance: InstanceId,
        kind: AccessKind,
        (t, r): (u64, u128),
        wake: impl FnOnce(),
    ) -> Dialling {
        let session = AccessSession {
            id: AccessSessionId::generate(t, r),
            instance_id: instance,
            kind,
        };
        let id = session.id.clone();
        let agent = self.open(node, session);
        wake();
        Dialling { id, agent }
    }

    /// Forgets a session (dialled, or given up).
    pub fn forget(&self, id: &AccessSessionId) {
        self.lock().remove(id);
    }

    /// The sessions `node`'s agent is to dial, oldest first. Sessions
    /// whose tenant left before the upgrade are forgotten on the way.
    pub fn for_node(&self, node: &NodeId) -> Vec<AccessSession> {
        let mut pending = self.lock();
        pending.retain(|_, p| !p.agent.is_closed());
        let mut out: Vec<AccessSession> = pending
            .values()
            .filter(|p| &p.node == node)
            .map(|p| p.session.clone())
            .collect();
        out.sort_by(|a, b| a.id.as_str().cmp(b.id.as_str()));
        out
    }

    /// Takes the session `id` of `node` for its agent's WebSocket; `None`
    /// when there is none (already dialled, given up, another node's).
    pub fn claim(&self, node: &NodeId, id: &AccessSessionId) -> Option<oneshot::Sender<WebSocket>> {
        let mut pending = self.lock();
        if pending.get(id).is_none_or(|p| &p.node != node) {
            return None;
        }
        pending.remove(id).map(|p| p.agent)
    }
}

/// A recorded session waiting for its agent (see [`Sessions::enter`]).
#[derive(Debug)]
pub struct Dialling {
    /// The session's id (`acc_…`), for logs.
    pub id: AccessSessionId,
    agent: oneshot::Receiver<WebSocket>,
}

impl Dialling {
    /// The agent's WebSocket once it dialled back; `None` when it did not
    /// within [`DIAL_TIMEOUT`] (the session is then forgotten, so a late
    /// dial-back finds nothing).
    pub async fn agent(self, sessions: &Sessions) -> Option<WebSocket> {
        match tokio::time::timeout(DIAL_TIMEOUT, self.agent).await {
            Ok(Ok(agent)) => Some(agent),
            _ => {
                sessions.forget(&self.id);
                tracing::warn!(session = %self.id, "the agent did not dial the session back");
                None
            }
        }
    }
}

/// The node `inst` runs on, or why it cannot be entered (it is not
/// running).
pub fn running_node(inst: &flotilla_core::api::Instance) -> Result<NodeId, String> {
    match (&inst.state, &inst.node_id) {
        (InstanceState::Running, Some(node)) => Ok(node.clone()),
        (state, _) => Err(format!(
            "instance {} is {}, not running",
            inst.id,
            state.as_str()
        )),
    }
}

/// What a tenant is told when its session's agent did not dial back.
pub const NOT_DIALLED: &str = "the instance's agent did not answer; try again";

/// Carries every data message of each WebSocket to the other until both
/// ended; one side's end closes the other's sending half, so that the
/// other side sees it and ends too. Pings stay with the side they were
/// sent to (each WebSocket answers its own).
pub async fn splice(tenant: WebSocket, agent: WebSocket) {
    let (mut tenant_tx, mut tenant_rx) = tenant.split();
    let (mut agent_tx, mut agent_rx) = agent.split();
    let up = async {
        while let Some(Ok(m)) = tenant_rx.next().await {
            match m {
                Message::Binary(_) | Message::Text(_) => {
                    if agent_tx.send(m).await.is_err() {
                        break;
                    }
                }
                Message::Close(_) => break,
                Message::Ping(_) | Message::Pong(_) => {}
            }
        }
        let _ = agent_tx.close().await;
    };
    let down = async {
        while let Some(Ok(m)) = agent_rx.next().await {
            match m {
                Message::Binary(_) | Message::Text(_) => {
                    if tenant_tx.send(m).await.is_err() {
                        break;
                    }
                }
                Message::Close(_) => break,
                Message::Ping(_) | Message::Pong(_) => {}
            }
        }
        let _ = tenant_tx.close().await;
    };
    tokio::join!(up, down);
}

#[cfg(test)]
mod tests {
    use super::*;
    use flotilla_core::access::AccessKind;
    use flotilla_core::id::InstanceId;

    fn session(n: u128) -> AccessSession {
        AccessSession {
            id: AccessSessionId::generate(1, n),
            instance_id: InstanceId::generate(1, n),
            kind: AccessKind::PortForward { port: 80 },
        }
    }

    #[test]
    fn a_session_is_listed_for_its_node_until_claimed_once() {
        let sessions = Sessions::default();
        let a = NodeId::generate(1, 1);
        let b = NodeId::generate(1, 2);
        let s = session(7);
        let _rx = sessions.open(a.clone(), s.clone());
        assert_eq!(sessions.for_node(&a), vec![s.clone()]);
        assert!(sessions.for_node(&b).is_empty());
        assert!(sessions.claim(&b, &s.id).is_none(), "another node's");
        assert!(sessions.claim(&a, &s.id).is_some());
        assert!(sessions.claim(&a, &s.id).is_none(), "claimed once");
        assert!(sessions.for_node(&a).is_empty());
    }

    #[test]
    fn entering_records_the_session_and_wakes_the_syncs_once() {
        let sessions = Sessions::default();
        let node = NodeId::generate(1, 1);
        let mut woken = 0;
        let dialling = sessions.enter(
            node.clone(),
            InstanceId::generate(1, 2),
            AccessKind::PortForward { port: 8080 },
            (1, 3),
            || woken += 1,
        );
        assert_eq!(woken, 1);
        let listed = sessions.for_node(&node);
        assert_eq!(listed.len(), 1);
        assert_eq!(listed[0].id, dialling.id);
        assert_eq!(listed[0].kind, AccessKind::PortForward { port: 8080 });
        // A caller that gave up (the SSH channel closed) leaves nothing.
        drop(dialling);
        assert!(sessions.for_node(&node).is_empty());
    }

    #[test]
    fn a_session_its_tenant_gave_up_is_not_listed() {
        let sessions = Sessions::default();
        let a = NodeId::generate(1, 1);
        let rx = sessions.open(a.clone(), session(8));
        drop(rx);
        assert!(sessions.for_node(&a).is_empty());
        assert!(sessions.lock().is_empty(), "forgotten");
    }
}
