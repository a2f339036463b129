//! Instance output, line by line, keyed by a per-instance sequence number
//! so an agent can resend a batch without duplicating lines.

use flotilla_core::api::{LogLine, LogStream};
use flotilla_core::id::InstanceId;
use sqlx::Row;

use crate::{at, ms, Result, Store, StoreError};

/// Rows per INSERT: keeps the statement under SQLite's bind limit.
const CHUNK: usize = 500;

impl Store {
    /// Appends lines; lines already stored (same seq) are ignored.
    pub async fn append_logs(&self, id: &InstanceId, lines: &[LogLine]) -> Result<()> {
        let mut tx = self.begin().await?;
        for chunk in lines.chunks(CHUNK) {
            let mut sql = String::from(
                "INSERT INTO instance_logs (instance_id, seq, stream, at, line) VALUES ",
            );
            for i in 0..chunk.len() {
                let b = i * 5;
                if i > 0 {
                    sql.push(',');
                }
                sql.push_str(&format!(
                    "(${}, ${}, ${}, ${}, ${})",
                    b + 1,
                    b + 2,
                    b + 3,
                    b + 4,
                    b + 5
                ));
            }
            sql.push_str(" ON CONFLICT (instance_id, seq) DO NOTHING");
            let mut q = sqlx::query(&sql);
            for l in chunk {
                q = q
                    .bind(id.as_str())
                    .bind(l.seq.min(i64::MAX as u64) as i64)
                    .bind(match l.stream {
                        LogStream::Stdout => "stdout",
                        LogStream::Stderr => "stderr",
                    })
                    .bind(ms(l.at))
                    .bind(l.line.clone());
            }
            q.execute(&mut *tx).await?;
        }
        crate::txn::commit(tx).await?;
        Ok(())
    }

    /// Lines with `seq >= since`, at most `limit`.
    pub async fn logs(&self, id: &InstanceId, since: u64, limit: u32) -> Result<Vec<LogLine>> {
        let rows = sqlx::query(
            "SELECT seq, stream, at, line FROM instance_logs WHERE instance_id = $1 AND seq >= $2 ORDER BY seq LIMIT $3",
        )
        .bind(id.as_str())
        .bind(since.min(i64::MAX as u64) as i64)
        .bind(i64::from(limit))
        .fetch_all(self.pool())
        .await?;
        rows.iter()
            .map(|r| {
                let stream: String = r.try_get("stream")?;
                Ok(LogLine {
                    seq: r.try_get::<i64, _>("seq")?.max(0) as u64,
                    stream: match stream.as_str() {
                        "stdout" => LogStream::Stdout,
                        "stderr" => LogStream::Stderr,
                        other => return Err(StoreError::Corrupt(format!("log stream `{other}`"))),
                    },
                    at: at(r.try_get("at")?),
                    line: r.try_get("line")?,
                })
            })
            .collect()
    }
}
