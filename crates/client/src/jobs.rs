//! Typed methods of the job routes (`/v1/jobs`): gangs of instances
//! placed whole, retried as a unit.

use flotilla_core::api::{Job, JobQueueEntry, Page};
use flotilla_core::id::JobId;
use flotilla_core::job::{CreateJob, JobState};

use crate::client::Client;
use crate::Result;

impl Client {
    /// `POST /v1/jobs`.
    pub async fn create_job(&self, req: &CreateJob) -> Result<Job> {
        self.post("/v1/jobs", req).await
    }

    /// `GET /v1/jobs/{id}`.
    pub async fn job(&self, id: &JobId) -> Result<Job> {
        self.get(&format!("/v1/jobs/{id}"), &[]).await
    }

    /// Every job of the key's (`GET /v1/jobs`, all pages), only those in
    /// `state` with one.
    pub async fn jobs(&self, state: Option<JobState>) -> Result<Vec<Job>> {
        let q: Vec<(&str, String)> = state
            .iter()
            .map(|s| ("state", s.as_str().to_string()))
            .collect();
        self.list("/v1/jobs", &q, None).await
    }

    /// `POST /v1/jobs/{id}/cancel`: queued, it ends at once; running, its
    /// members stop.
    pub async fn cancel_job(&self, id: &JobId) -> Result<Job> {
        self.post(&format!("/v1/jobs/{id}/cancel"), &serde_json::Map::new())
            .await
    }

    /// `GET /v1/jobs/queue`: jobs waiting for GPUs, in the scheduler's
    /// order (one page: the server lists the whole queue at once).
    pub async fn job_queue(&self) -> Result<Vec<JobQueueEntry>> {
        let page: Page<JobQueueEntry> = self.get("/v1/jobs/queue", &[]).await?;
        Ok(page.items)
    }
}
