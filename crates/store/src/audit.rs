//! The audit log: who changed what, when, and how it ended. Rows are only
//! ever inserted; pages run newest first, since that is what an operator
//! looking into an incident reads.

use flotilla_core::api::AuditEntry;
use flotilla_core::id::{AuditId, KeyId, TenantId};
use sqlx::any::AnyRow;
use sqlx::Row;

use crate::{at, ms, PageOf, PageReq, Result, Store, StoreError};

fn entry(row: &AnyRow) -> Result<AuditEntry> {
    let status: i64 = row.try_get("status")?;
    Ok(AuditEntry {
        id: AuditId::from_trusted(row.try_get("id")?),
        at: at(row.try_get("at")?),
        key_id: KeyId::from_trusted(row.try_get("key_id")?),
        tenant_id: TenantId::from_trusted(row.try_get("tenant_id")?),
        method: row.try_get("method")?,
        route: row.try_get("route")?,
        object_id: row.try_get("object_id")?,
        status: u16::try_from(status)
            .map_err(|_| StoreError::Corrupt(format!("audit status {status}")))?,
        request_id: row.try_get("request_id")?,
    })
}

impl Store {
    /// Appends one entry.
    pub async fn record_audit(&self, e: &AuditEntry) -> Result<()> {
        sqlx::query(
            "INSERT INTO audit_log (id, at, key_id, tenant_id, method, route, object_id, status, request_id) \
             VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9)",
        )
        .bind(e.id.as_str())
        .bind(ms(e.at))
        .bind(e.key_id.as_str())
        .bind(e.tenant_id.as_str())
        .bind(&e.method)
        .bind(&e.route)
        .bind(e.object_id.as_deref())
        .bind(i64::from(e.status))
        .bind(e.request_id.as_deref())
        .execute(self.writer())
        .await?;
        Ok(())
    }

    /// Entries newest first, optionally of one tenant; the cursor is the
    /// last id of the previous page.
    pub async fn list_audit(
        &self,
        only: Option<&TenantId>,
        page: &PageReq,
    ) -> Result<PageOf<AuditEntry>> {
        let rows = self
            .page_rows(
            "SELECT * FROM audit_log WHERE ($1 = '' OR id < $1) AND ($2 = '' OR tenant_id = $2) \
             ORDER BY id DESC LIMIT $3",
                only,
                page,
            )
            .await?;
        let items = rows.iter().map(entry).collect::<Result<Vec<_>>>()?;
        Ok(PageOf::from_overfetch(items, page, |e| e.id.to_string()))
    }
}
