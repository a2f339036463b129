//! Usage delivery: every finished request's [`RequestUsage`] goes into a
//! bounded buffer that a task hands to `Control::meter` in batches. A
//! failed batch goes back to the front and is retried with backoff, so
//! records are delivered in order and at least once (the control plane
//! dedupes by request id). Only a full buffer drops records, and each drop
//! is counted on `/metrics` and logged.

use std::collections::VecDeque;
use std::sync::Mutex;
use std::time::Duration;

use flotilla_core::gateway::RequestUsage;
use prometheus_client::metrics::counter::Counter;
use tokio::sync::Notify;

pub(crate) struct MeterQueue {
    buf: Mutex<VecDeque<RequestUsage>>,
    capacity: usize,
    batch: usize,
    pub wake: Notify,
    dropped: Counter,
}

impl MeterQueue {
    pub fn new(capacity: usize, batch: usize, dropped: Counter) -> Self {
        Self {
            buf: Mutex::new(VecDeque::new()),
            capacity: capacity.max(1),
            batch: batch.max(1),
            wake: Notify::new(),
            dropped,
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, VecDeque<RequestUsage>> {
        self.buf.lock().unwrap_or_else(|p| p.into_inner())
    }

    pub fn push(&self, usage: RequestUsage) {
        let len = {
            let mut buf = self.lock();
            if buf.len() >= self.capacity {
                if let Some(lost) = buf.pop_front() {
                    self.dropped.inc();
                    tracing::error!(request_id = %lost.request_id, capacity = self.capacity,
                        "usage buffer full, the control plane is not accepting usage: oldest record dropped");
                }
            }
            buf.push_back(usage);
            buf.len()
        };
        if len >= self.batch {
            self.wake.notify_one();
        }
    }

    pub fn pending(&self) -> usize {
        self.lock().len()
    }

    fn take(&self) -> Vec<RequestUsage> {
        let mut buf = self.lock();
        let n = buf.len().min(self.batch);
        buf.drain(..n).collect()
    }

    fn put_back(&self, batch: Vec<RequestUsage>) {
        let mut buf = self.lock();
        for u in batch.into_iter().rev() {
            buf.push_front(u);
        }
        while buf.len() > self.capacity {
            if let Some(lost) = buf.pop_back() {
                self.dropped.inc();
                tracing::error!(request_id = %lost.request_id, "usage buffer full: newest record dropped");
            }
        }
    }

    /// Delivers one batch; `Ok(true)` when something was sent.
    pub async fn flush_once(
        &self,
        control: &dyn crate::Control,
    ) -> Result<bool, crate::ControlError> {
        let batch = self.take();
        if batch.is_empty() {
            return Ok(false);
        }
        match control.meter(batch.clone()).await {
            Ok(()) => Ok(true),
            Err(e) => {
                self.put_back(batch);
                Err(e)
            }
        }
    }
}

/// The next wait after `failures` failed deliveries in a row.
pub(crate) fn backoff(failures: u32) -> Duration {
    Duration::from_millis(100u64.saturating_mul(1 << failures.min(6))).min(Duration::from_secs(5))
}
