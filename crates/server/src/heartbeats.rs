//! Group commit of agents' heartbeats. Every sync records its node's
//! heartbeat twice (on arrival, and on answering a held long poll, which
//! renews the node's lease), and each record was its own one-row UPDATE
//! and commit: at a fleet of thousands of nodes, more than a thousand
//! commits a second, most of the database's work. Here the syncs of one
//! replica hand their heartbeats to one writer, which writes whatever has
//! gathered while its last write ran as one statement
//! ([`Store::heartbeat_many`]): a lone sync is written at once, a crowd in
//! a few commits.
//!
//! A sync still answers only after its heartbeat is committed, so what the
//! server records of a node's lease never trails what the agent was told
//! (see the sync route). Should a batch fail, each of its syncs writes its
//! own heartbeat and so gets its own error.

use std::collections::HashMap;
use std::sync::OnceLock;

use chrono::{DateTime, Utc};
use flotilla_core::id::NodeId;
use flotilla_core::node::NodeState;
use flotilla_store::{Store, StoreError};
use tokio::sync::{mpsc, oneshot};

/// The most heartbeats one statement carries.
const MOST_PER_BATCH: usize = 1_000;

/// What the writer answers a heartbeat: the node's state before it, `None`
/// for a node that does not exist; the outer `None` when the batch failed.
type Answer = Option<Option<NodeState>>;

struct Beat {
    node: NodeId,
    at: DateTime<Utc>,
    done: oneshot::Sender<Answer>,
}

/// One replica's heartbeat writer, started on first use (inside the
/// runtime that serves the syncs).
#[derive(Default)]
pub struct Heartbeats {
    writer: OnceLock<mpsc::UnboundedSender<Beat>>,
}

impl std::fmt::Debug for Heartbeats {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Heartbeats")
    }
}

impl Heartbeats {
    /// Records that `node`'s agent was heard at `at`, committed with the
    /// heartbeats of other syncs waiting at the same time; the node's state
    /// before it, or `NotFound`.
    pub async fn beat(
        &self,
        store: &Store,
        node: &NodeId,
        at: DateTime<Utc>,
    ) -> Result<NodeState, StoreError> {
        let writer = self.writer.get_or_init(|| {
            let (tx, rx) = mpsc::unbounded_channel();
            tokio::spawn(write(store.clone(), rx));
            tx
        });
        let (done, answer) = oneshot::channel();
        let sent = writer.send(Beat {
            node: node.clone(),
            at,
            done,
        });
        if sent.is_ok() {
            match answer.await {
                Ok(Some(Some(state))) => return Ok(state),
                Ok(Some(None)) => return Err(StoreError::NotFound("node")),
                // The batch failed, or the writer is gone (its runtime
                // ended): this heartbeat alone, with its own error.
                Ok(None) | Err(_) => {}
            }
        }
        store.heartbeat(node, at).await
    }
}

/// The writer: takes the first heartbeat waiting, then every other one
/// already waiting (up to [`MOST_PER_BATCH`]), writes them in one statement
/// and answers each.
async fn write(store: Store, mut beats: mpsc::UnboundedReceiver<Beat>) {
    while let Some(first) = beats.recv().await {
        let mut batch = vec![first];
        while batch.len() < MOST_PER_BATCH {
            match beats.try_recv() {
                Ok(b) => batch.push(b),
                Err(_) => break,
            }
        }
        let wanted: Vec<(NodeId, DateTime<Utc>)> =
            batch.iter().map(|b| (b.node.clone(), b.at)).collect();
        let states: Option<HashMap<NodeId, NodeState>> = match store.heartbeat_many(&wanted).await {
            Ok(states) => Some(states),
            Err(error) => {
                tracing::warn!(%error, heartbeats = batch.len(), "a batch of heartbeats failed; each is written alone");
                None
            }
        };
        for b in batch {
            let answer = states.as_ref().map(|s| s.get(&b.node).copied());
            // A sync that gave up waiting no longer listens.
            let _ = b.done.send(answer);
        }
    }
}
