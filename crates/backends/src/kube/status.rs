//! A pod's status as the agent protocol's [`ObservedInstance`]. Pure.
//!
//! | Pod                                          | Observed                       |
//! |----------------------------------------------|--------------------------------|
//! | `Pending`, waiting to pull / create          | `starting` (the reason as message) |
//! | `Pending`, waiting on a bad image or config  | `failed_to_start`              |
//! | `Failed` before the container ran (rejected by the kubelet, e.g. `OutOfnvidia.com/gpu`) | `failed_to_start` |
//! | `Running`                                    | `running` (since the container started) |
//! | `Succeeded` / `Failed` after running         | `exited` with the exit code, at its finish |
//!
//! Usage is metered from these times, so they are the pod's own (the
//! container's `startedAt` and `finishedAt`), not when the watch saw them.

use chrono::{DateTime, Utc};
use flotilla_core::api::{
    ColdStart, ObservedContainer, ObservedInstance, ObservedPhase, PublishedPort,
};
use flotilla_core::id::InstanceId;
use k8s_openapi::api::core::v1::{ContainerStatus, Pod};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;

use super::pods::{CONTAINER, LABEL_INSTANCE};

/// Waiting reasons that do not clear without a new pod: the image cannot
/// be pulled or the container cannot be created as specified.
const FATAL_WAITING: &[&str] = &[
    "ErrImagePull",
    "ImagePullBackOff",
    "InvalidImageName",
    "ErrImageNeverPull",
    "CreateContainerConfigError",
    "CreateContainerError",
    "RunContainerError",
];

/// Exit code reported when a pod vanished without a container exit code:
/// SIGKILL (128 + 9), as the agent reports a killed process.
pub const KILLED: i32 = 137;
/// Exit code of a requested stop whose pod vanished before reporting one:
/// SIGTERM (128 + 15).
pub const TERMINATED: i32 = 143;

/// The instance a Flotilla pod runs, from its label.
pub fn instance_of(pod: &Pod) -> Option<InstanceId> {
    let v = pod.metadata.labels.as_ref()?.get(LABEL_INSTANCE)?;
    InstanceId::parse(v, LABEL_INSTANCE).ok()
}

/// The node a pod is bound to, or pinned to by a hostname selector while
/// it waits for the scheduler.
pub fn node_of(pod: &Pod) -> Option<&str> {
    let spec = pod.spec.as_ref()?;
    spec.node_name.as_deref().or_else(|| {
        spec.node_selector
            .as_ref()?
            .get("kubernetes.io/hostname")
            .map(String::as_str)
    })
}

/// Converts an API time.
pub fn time(t: &Time) -> DateTime<Utc> {
    let ts = t.0;
    DateTime::from_timestamp(
        ts.as_second(),
        u32::try_from(ts.subsec_nanosecond()).unwrap_or(0),
    )
    .unwrap_or_default()
}

fn main_status(pod: &Pod) -> Option<&ContainerStatus> {
    pod.status
        .as_ref()?
        .container_statuses
        .as_ref()?
        .iter()
        .find(|c| c.name == CONTAINER)
}

/// The container's declared ports at the pod's IP: pods are reached
/// directly on the cluster network (as far as the tenant namespace's
/// network policy lets them), so the "host" port is the container port.
fn published_ports(pod: &Pod) -> Vec<PublishedPort> {
    let Some(ip) = pod.status.as_ref().and_then(|s| s.pod_ip.as_deref()) else {
        return vec![];
    };
    let host = if ip.contains(':') {
        format!("[{ip}]")
    } else {
        ip.to_string()
    };
    pod.spec
        .as_ref()
        .and_then(|s| s.containers.iter().find(|c| c.name == CONTAINER))
        .and_then(|c| c.ports.as_ref())
        .map(|ports| {
            ports
                .iter()
                .filter_map(|p| u16::try_from(p.container_port).ok())
                .map(|port| PublishedPort {
                    container_port: port,
                    host_port: port,
                    url: format!("http://{host}:{port}"),
                })
                .collect()
        })
        .unwrap_or_default()
}

/// The cold-start breakdown the pod's status allows, once its container
/// has started: the sandbox was ready (`PodReadyToStartContainers` turned
/// true: the kubelet then pulls the image) at `pull_started_at`, and the
/// container started at `ready_at`. The status carries no pull times
/// (those are in the kubelet's Events, which the executor does not read),
/// so the pull, the create and the start are one step, `starting_ms`, and
/// `pulling_ms` is left unknown. Kubernetes times have whole seconds.
pub fn cold_start(pod: &Pod, main: &ContainerStatus) -> Option<ColdStart> {
    let state = main.state.as_ref()?;
    let ready = state
        .running
        .as_ref()
        .and_then(|r| r.started_at.as_ref())
        .or_else(|| {
            state
                .terminated
                .as_ref()
                .and_then(|t| t.started_at.as_ref())
        })
        .map(time)?;
    let sandbox = pod
        .status
        .as_ref()?
        .conditions
        .as_ref()?
        .iter()
        .find(|c| c.type_ == "PodReadyToStartContainers" && c.status == "True")
        .and_then(|c| c.last_transition_time.as_ref())
        .map(time)?;
    Some(ColdStart {
        image_cached: false,
        queued_ms: None,
        pulling_ms: None,
        starting_ms: u64::try_from((ready - sandbox).num_milliseconds()).ok(),
        pull_started_at: Some(sandbox),
        created_at: None,
        ready_at: Some(ready),
        // The executor does not know which tier the pod's image loaded
        // its weights from.
        weights_tier: None,
    })
}

/// What the pod says of its instance. `stopped`: the executor deleted it
/// because the server asked for a stop. `seen`: when the watch saw this
/// version, for phases the pod carries no time for.
pub fn observe(pod: &Pod, stopped: bool, seen: DateTime<Utc>) -> Option<ObservedInstance> {
    let instance_id = instance_of(pod)?;
    let status = pod.status.as_ref();
    let phase = status.and_then(|s| s.phase.as_deref()).unwrap_or("Pending");
    let created = pod.metadata.creation_timestamp.as_ref().map(time);
    let started = status.and_then(|s| s.start_time.as_ref()).map(time);
    let main = main_status(pod);
    let state = main.and_then(|c| c.state.as_ref());
    let ports = published_ports(pod);
    let container = main.and_then(|c| {
        c.container_id.as_ref().map(|id| ObservedContainer {
            container_id: id.clone(),
            ports: ports.clone(),
            cold_start: cold_start(pod, c),
            oom_killed: c
                .state
                .as_ref()
                .and_then(|s| s.terminated.as_ref())
                .and_then(|t| t.reason.as_deref())
                == Some("OOMKilled"),
        })
    });
    let pod_reason = status.and_then(|s| s.reason.clone());
    let pod_message = status.and_then(|s| s.message.clone());

    // The container's own start, sent with its exit: a pod that ran and
    // ended between two watch events is metered from it, not from its end.
    let mut ran_from = None;
    let (phase, at, message) = if let Some(t) = state.and_then(|s| s.terminated.as_ref()) {
        let at = t.finished_at.as_ref().map(time).unwrap_or(seen);
        ran_from = t.started_at.as_ref().map(time);
        (
            ObservedPhase::Exited {
                code: t.exit_code,
                stopped,
            },
            at,
            t.reason.clone(),
        )
    } else if let Some(r) = state.and_then(|s| s.running.as_ref()) {
        let at = r.started_at.as_ref().map(time).or(started).unwrap_or(seen);
        (ObservedPhase::Running { pid: 0 }, at, None)
    } else if phase == "Failed" || phase == "Succeeded" {
        // Ended without a container that ran: the kubelet refused it
        // (`OutOfnvidia.com/gpu`, `UnexpectedAdmissionError`) or evicted it
        // before its container started.
        let reason = match (&pod_reason, &pod_message) {
            (Some(r), Some(m)) => format!("{r}: {m}"),
            (Some(r), None) => r.clone(),
            (None, Some(m)) => m.clone(),
            (None, None) => format!("pod {phase} before its container started"),
        };
        (ObservedPhase::FailedToStart { reason }, seen, None)
    } else if let Some(w) = state.and_then(|s| s.waiting.as_ref()) {
        let reason = w.reason.clone().unwrap_or_default();
        let text = match &w.message {
            Some(m) => format!("{reason}: {m}"),
            None => reason.clone(),
        };
        if FATAL_WAITING.contains(&reason.as_str()) {
            (ObservedPhase::FailedToStart { reason: text }, seen, None)
        } else {
            (ObservedPhase::Starting, created.unwrap_or(seen), Some(text))
        }
    } else {
        // Not bound or not started yet: the scheduler's condition says why.
        let unscheduled = status
            .and_then(|s| s.conditions.as_ref())
            .and_then(|cs| {
                cs.iter()
                    .find(|c| c.type_ == "PodScheduled" && c.status == "False")
            })
            .and_then(|c| c.message.clone());
        (
            ObservedPhase::Starting,
            created.unwrap_or(seen),
            unscheduled,
        )
    };
    Some(ObservedInstance {
        instance_id,
        phase,
        at,
        started_at: ran_from,
        message,
        container,
        weights_tier: None,
        limit_exceeded: None,
    })
}

/// The last word on a pod that is gone: its final status when it had
/// ended, else an exit as a killed process (143 when Flotilla stopped it,
/// 137 when something else deleted it: an eviction, a person, a drained
/// node), at the time of deletion.
pub fn tombstone(pod: &Pod, stopped: bool, seen: DateTime<Utc>) -> Option<ObservedInstance> {
    let mut o = observe(pod, stopped, seen)?;
    match o.phase {
        ObservedPhase::Exited { .. } | ObservedPhase::FailedToStart { .. } => {}
        ObservedPhase::Starting | ObservedPhase::Running { .. } => {
            o.phase = ObservedPhase::Exited {
                code: if stopped { TERMINATED } else { KILLED },
                stopped,
            };
            o.at = pod
                .metadata
                .deletion_timestamp
                .as_ref()
                .map(time)
                .unwrap_or(seen);
            o.message = Some(if stopped {
                "pod deleted on request".into()
            } else {
                "pod deleted outside Flotilla".into()
            });
        }
    }
    Some(o)
}

#[cfg(test)]
mod tests {
    use super::*;
    use k8s_openapi::api::core::v1::{
        ContainerState, ContainerStateRunning, ContainerStateTerminated, ContainerStateWaiting,
        PodSpec, PodStatus,
    };
    use k8s_openapi::jiff::Timestamp;
    use std::collections::BTreeMap;

    const ID: &str = "inst_01jd3x7k2q9v8m4n6p5r0s1t2w";

    fn pod(phase: &str, state: Option<ContainerState>) -> Pod {
        let mut p = Pod::default();
        p.metadata.labels = Some(BTreeMap::from([(
            LABEL_INSTANCE.to_string(),
            ID.to_string(),
        )]));
        p.metadata.creation_timestamp = Some(Time(Timestamp::from_second(1_700_000_000).unwrap()));
        p.spec = Some(PodSpec {
            node_name: Some("n1".into()),
            ..Default::default()
        });
        p.status = Some(PodStatus {
            phase: Some(phase.into()),
            container_statuses: state.map(|s| {
                vec![ContainerStatus {
                    name: CONTAINER.into(),
                    container_id: Some("containerd://abc".into()),
                    state: Some(s),
                    ..Default::default()
                }]
            }),
            ..Default::default()
        });
        p
    }

    fn seen() -> DateTime<Utc> {
        DateTime::from_timestamp(1_700_000_500, 0).unwrap()
    }

    #[test]
    fn a_bad_image_fails_to_start_and_a_pull_in_progress_is_starting() {
        let waiting = |reason: &str| ContainerState {
            waiting: Some(ContainerStateWaiting {
                reason: Some(reason.into()),
                message: Some("rpc error: not found".into()),
            }),
            ..Default::default()
        };
        let o = observe(
            &pod("Pending", Some(waiting("ImagePullBackOff"))),
            false,
            seen(),
        )
        .unwrap();
        assert_eq!(
            o.phase,
            ObservedPhase::FailedToStart {
                reason: "ImagePullBackOff: rpc error: not found".into()
            }
        );
        let o = observe(
            &pod("Pending", Some(waiting("ContainerCreating"))),
            false,
            seen(),
        )
        .unwrap();
        assert_eq!(o.phase, ObservedPhase::Starting);
        assert_eq!(
            o.at,
            DateTime::from_timestamp(1_700_000_000, 0).unwrap(),
            "since creation"
        );
    }

    #[test]
    fn an_oom_kill_is_an_exit_with_the_flag() {
        let st = ContainerState {
            terminated: Some(ContainerStateTerminated {
                exit_code: 137,
                reason: Some("OOMKilled".into()),
                finished_at: Some(Time(Timestamp::from_second(1_700_000_100).unwrap())),
                ..Default::default()
            }),
            ..Default::default()
        };
        let o = observe(&pod("Failed", Some(st)), false, seen()).unwrap();
        assert_eq!(
            o.phase,
            ObservedPhase::Exited {
                code: 137,
                stopped: false
            }
        );
        assert!(o.container.unwrap().oom_killed);
        assert_eq!(o.at, DateTime::from_timestamp(1_700_000_100, 0).unwrap());
    }

    #[test]
    fn a_running_pod_that_vanishes_was_killed_unless_flotilla_stopped_it() {
        let running = ContainerState {
            running: Some(ContainerStateRunning {
                started_at: Some(Time(Timestamp::from_second(1_700_000_050).unwrap())),
            }),
            ..Default::default()
        };
        let p = pod("Running", Some(running));
        let o = observe(&p, false, seen()).unwrap();
        assert_eq!(o.phase, ObservedPhase::Running { pid: 0 });
        assert_eq!(o.at, DateTime::from_timestamp(1_700_000_050, 0).unwrap());
        let gone = tombstone(&p, false, seen()).unwrap();
        assert_eq!(
            gone.phase,
            ObservedPhase::Exited {
                code: KILLED,
                stopped: false
            }
        );
        let stopped = tombstone(&p, true, seen()).unwrap();
        assert_eq!(
            stopped.phase,
            ObservedPhase::Exited {
                code: TERMINATED,
                stopped: true
            }
        );
    }

    #[test]
    fn the_cold_start_runs_from_the_ready_sandbox_to_the_container_start() {
        let running = ContainerState {
            running: Some(ContainerStateRunning {
                started_at: Some(Time(Timestamp::from_second(1_700_000_048).unwrap())),
            }),
            ..Default::default()
        };
        let mut p = pod("Running", Some(running));
        let c = observe(&p, false, seen()).unwrap().container.unwrap();
        assert_eq!(c.cold_start, None, "no sandbox condition yet");
        p.status.as_mut().unwrap().conditions =
            Some(vec![k8s_openapi::api::core::v1::PodCondition {
                type_: "PodReadyToStartContainers".into(),
                status: "True".into(),
                last_transition_time: Some(Time(Timestamp::from_second(1_700_000_013).unwrap())),
                ..Default::default()
            }]);
        let c = observe(&p, false, seen()).unwrap().container.unwrap();
        let cold = c.cold_start.unwrap();
        assert_eq!(cold.starting_ms, Some(35_000));
        assert_eq!(cold.pulling_ms, None, "the status has no pull times");
        assert_eq!(
            cold.pull_started_at,
            DateTime::from_timestamp(1_700_000_013, 0)
        );
        assert_eq!(cold.ready_at, DateTime::from_timestamp(1_700_000_048, 0));
    }

    #[test]
    fn a_running_pod_publishes_its_ports_at_its_ip() {
        let running = ContainerState {
            running: Some(ContainerStateRunning { started_at: None }),
            ..Default::default()
        };
        let mut p = pod("Running", Some(running));
        p.spec.as_mut().unwrap().containers = vec![k8s_openapi::api::core::v1::Container {
            name: CONTAINER.into(),
            ports: Some(vec![k8s_openapi::api::core::v1::ContainerPort {
                container_port: 8000,
                ..Default::default()
            }]),
            ..Default::default()
        }];
        p.status.as_mut().unwrap().pod_ip = Some("10.244.1.23".into());
        let c = observe(&p, false, seen()).unwrap().container.unwrap();
        assert_eq!(c.ports.len(), 1);
        assert_eq!(c.ports[0].url, "http://10.244.1.23:8000");
    }

    #[test]
    fn a_pod_waiting_for_the_scheduler_belongs_to_its_selected_node() {
        let mut p = pod("Pending", None);
        p.spec = Some(PodSpec {
            node_selector: Some(BTreeMap::from([(
                "kubernetes.io/hostname".to_string(),
                "n2".to_string(),
            )])),
            ..Default::default()
        });
        assert_eq!(node_of(&p), Some("n2"));
        let o = observe(&p, false, seen()).unwrap();
        assert_eq!(o.phase, ObservedPhase::Starting);
        assert!(instance_of(&Pod::default()).is_none());
    }
}
