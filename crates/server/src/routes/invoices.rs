//! Finalised invoices and the per-tenant terms rating applies: reserved
//! commitments, discounts and credit grants.
//!
//! Operators finalise a month: each tenant's usage is rated with the
//! catalog, spot series and terms, marked final and stored once; a final
//! invoice never changes (finalising it again is 409), and corrections
//! that arrive later go on a later invoice.

use axum::extract::{Path, State};
use axum::http::{HeaderMap, StatusCode, Uri};
use axum::response::{IntoResponse, Response};
use axum::Json;
use flotilla_billing::api::{FinalizeRequest, NewTerm};
use flotilla_billing::invoice::Invoice;
use flotilla_billing::price::{Commitment, CreditGrant, Discount};
use flotilla_core::api::Page;
use flotilla_core::id::InvoiceId;
use flotilla_core::FieldError;
use flotilla_store::PageReq;
use rust_decimal::Decimal;

use crate::auth::Caller;
use crate::error::{ApiError, ApiResult};
use crate::extract::{ApiJson, Pagination};
use crate::pricing::{finalise_invoice, price_book, store_final, RatingError};
use crate::routes::export::{csv_response, invoices_csv, wants_csv};
use crate::routes::path_id;
use crate::routes::prices::billing_field;
use crate::routes::tenants::visible_tenant;
use crate::routes::usage::{grace, parse_month};
use crate::state::AppState;
pub use flotilla_billing::api::{Finalized, Skipped, Terms};

/// Finalised invoices of the caller's tenant (operators: every tenant's),
/// oldest first. Each is the stored invoice, byte for byte: `id`,
/// `tenant`, `period`, `currency`, `status` (`finalised` with `at`),
/// `lines` (kind, description, model, quantity, unit, unit_price, amount,
/// price_version, price_point_at, reference, tier), `subtotal`, `total`.
#[utoipa::path(get, path = "/v1/invoices", tag = "billing",
    params(("limit" = Option<u32>, Query, description = "page size, 1-1000"),
           ("cursor" = Option<String>, Query, description = "from next_cursor"),
           ("format" = Option<String>, Query, description = "csv: one row per invoice line (also `Accept: text/csv`)")),
    responses((status = 200, body = Object, description = "a page of invoices"),
              (status = 400, body = flotilla_core::api::ErrorBody)))]
pub async fn list_invoices(
    State(st): State<AppState>,
    caller: Caller,
    page: Pagination,
    headers: HeaderMap,
    uri: Uri,
) -> ApiResult<Response> {
    let csv = wants_csv(&uri, &headers)?;
    let p = st
        .store()
        .list_invoices(caller.scope(), &PageReq::new(page.cursor, page.limit))
        .await?;
    if csv {
        return Ok(csv_response(invoices_csv(&p.items)?, p.next.as_deref()));
    }
    Ok(Json(Page {
        items: p.items,
        next_cursor: p.next,
    })
    .into_response())
}

/// One finalised invoice; another tenant's is 404.
#[utoipa::path(get, path = "/v1/invoices/{invoice_id}", tag = "billing",
    params(("invoice_id" = String, Path, description = "inv_…"),
           ("format" = Option<String>, Query, description = "csv: one row per line")),
    responses((status = 200, body = Object, description = "the invoice"),
              (status = 404, body = flotilla_core::api::ErrorBody)))]
pub async fn get_invoice(
    State(st): State<AppState>,
    caller: Caller,
    Path(raw): Path<String>,
    headers: HeaderMap,
    uri: Uri,
) -> ApiResult<Response> {
    let id = path_id(&raw, "invoice_id", InvoiceId::parse)?;
    let (tenant, body) = st.store().invoice_json(&id).await?;
    if !caller.sees(&tenant) {
        return Err(ApiError::not_found("invoice"));
    }
    if wants_csv(&uri, &headers)? {
        let inv: Invoice = serde_json::from_str(&body).map_err(ApiError::internal)?;
        return Ok(csv_response(invoices_csv(&[inv])?, None));
    }
    // The stored bytes, as finalised: nothing re-serialises a final invoice.
    Ok((
        [(axum::http::header::CONTENT_TYPE, "application/json")],
        body,
    )
        .into_response())
}

/// Finalises a month (operators): each tenant's usage is rated, marked
/// final and stored with its credit draws. Refused (409) until the grace
/// window for late events (72 h) has passed after the month's end, and for
/// a named tenant whose invoice is already final; without a tenant, every
/// tenant with lines is finalised and those already final are skipped, so
/// re-running it is safe.
#[utoipa::path(post, path = "/v1/invoices/finalise", tag = "billing",
    request_body = FinalizeRequest,
    responses((status = 200, body = Finalized),
              (status = 403, body = flotilla_core::api::ErrorBody),
              (status = 409, body = flotilla_core::api::ErrorBody),
              (status = 422, body = flotilla_core::api::ErrorBody)))]
pub async fn finalise_invoices(
    State(st): State<AppState>,
    caller: Caller,
    ApiJson(req): ApiJson<FinalizeRequest>,
) -> ApiResult<Json<Finalized>> {
    caller.require(&[], "finalise invoices")?;
    let period = parse_month(Some(&req.period))
        .map_err(|_| ApiError::field(FieldError::new("period", "must be a month like 2025-01")))?;
    let now = st.now();
    if now < period.end + grace() {
        return Err(ApiError::conflict(format!(
            "the period is open for late usage until {} (its end plus the 72 h grace window)",
            (period.end + grace()).to_rfc3339()
        )));
    }
    let tenants = match &req.tenant {
        Some(t) => {
            st.store()
                .tenant(t)
                .await
                .map_err(|_| ApiError::field(FieldError::new("tenant", "no such tenant")))?;
            vec![t.clone()]
        }
        None => {
            let mut all = Vec::new();
            let mut after = None;
            loop {
                let page = st
                    .store()
                    .list_tenants(None, &PageReq::new(after, 1000))
                    .await?;
                all.extend(page.items.into_iter().map(|t| t.id));
                match page.next {
                    Some(n) => after = Some(n),
                    None => break,
                }
            }
            all
        }
    };
    let mut out = Finalized {
        finalised: Vec::new(),
        skipped: Vec::new(),
    };
    for tenant in tenants {
        let (t, r) = st.ids();
        let id = InvoiceId::generate(t, r);
        let inv = if req.tenant.is_some() {
            finalise_invoice(st.store(), st.catalog(), &tenant, period, &id, now, grace()).await?
        } else {
            if st
                .store()
                .final_invoice_of(&tenant, period.start)
                .await?
                .is_some()
            {
                out.skipped.push(Skipped {
                    tenant,
                    reason: "already_final".into(),
                });
                continue;
            }
            let draft =
                crate::pricing::draft_invoice(st.store(), st.catalog(), &tenant, period, &id, now)
                    .await?;
            // Tenants with nothing to bill get no invoice.
            if draft.invoice.lines().is_empty() {
                out.skipped.push(Skipped {
                    tenant,
                    reason: "nothing_to_bill".into(),
                });
                continue;
            }
            match store_final(st.store(), draft, now, grace()).await {
                Ok(inv) => inv,
                // Finalised by another call meanwhile: as if already final.
                Err(RatingError::Store(flotilla_store::StoreError::Conflict(_))) => {
                    out.skipped.push(Skipped {
                        tenant,
                        reason: "already_final".into(),
                    });
                    continue;
                }
                Err(e) => return Err(e.into()),
            }
        };
        tracing::info!(invoice = %inv.id(), tenant = %tenant, total = %inv.total(), "invoice finalised");
        out.finalised.push(inv);
    }
    Ok(Json(out))
}

fn term_id(id: &str) -> ApiResult<()> {
    if id.is_empty()
        || id.len() > 64
        || !id
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || "-_.".contains(c))
    {
        return Err(ApiError::field(FieldError::new(
            "id",
            "must be 1-64 letters, digits, '-', '_' or '.'",
        )));
    }
    Ok(())
}

/// The tenant's commitments, discounts and credits, and what finalised
/// invoices drew from each credit. Another tenant's: 404.
#[utoipa::path(get, path = "/v1/tenants/{tenant_id}/terms", tag = "billing",
    params(("tenant_id" = String, Path, description = "ten_…")),
    responses((status = 200, body = Terms), (status = 404, body = flotilla_core::api::ErrorBody)))]
pub async fn get_terms(
    State(st): State<AppState>,
    caller: Caller,
    Path(raw): Path<String>,
) -> ApiResult<Json<Terms>> {
    let tenant = visible_tenant(&st, &caller, &raw).await?;
    Ok(Json(Terms {
        commitments: st.store().commitments(&tenant).await?,
        discounts: st.store().discounts(&tenant).await?,
        credits: st.store().credits(&tenant).await?,
        credit_drawn: st.store().credit_drawn(&tenant).await?,
    }))
}

/// Adds a commitment, discount or credit to a tenant (operators). Terms
/// are never edited: a commitment's price is locked when it is signed; ids
/// are unique per kind (409 when taken).
#[utoipa::path(post, path = "/v1/tenants/{tenant_id}/terms", tag = "billing",
    params(("tenant_id" = String, Path, description = "ten_…")),
    request_body = NewTerm,
    responses((status = 201, body = Object, description = "the stored term"),
              (status = 403, body = flotilla_core::api::ErrorBody),
              (status = 404, body = flotilla_core::api::ErrorBody),
              (status = 409, body = flotilla_core::api::ErrorBody),
              (status = 422, body = flotilla_core::api::ErrorBody)))]
pub async fn add_term(
    State(st): State<AppState>,
    caller: Caller,
    Path(raw): Path<String>,
    ApiJson(req): ApiJson<NewTerm>,
) -> ApiResult<(StatusCode, Json<serde_json::Value>)> {
    let tenant = visible_tenant(&st, &caller, &raw).await?;
    caller.require(&[], "add billing terms")?;
    let now = st.now();
    // Terms change the month's spend: its budget is rated again.
    let touched = tenant.clone();
    let stored = match req {
        NewTerm::Commitment {
            id,
            model,
            gpus,
            start,
            term_days,
            payment,
            discount,
        } => {
            term_id(&id)?;
            let model = st.catalog().resolve(&model, "model")?;
            let book = price_book(st.store(), st.catalog(), now).await?;
            let discount = match discount {
                Some(d) => d,
                None => book
                    .in_force(start)
                    .map_err(|e| ApiError::field(FieldError::new("start", e.to_string())))?
                    .reserved_offers
                    .iter()
                    .find(|o| o.term_days == term_days)
                    .map(|o| o.discount)
                    .ok_or_else(|| {
                        ApiError::field(FieldError::new(
                            "discount",
                            format!("is required: the catalog offers no {term_days}-day term"),
                        ))
                    })?,
            };
            let c = Commitment::sign(
                &id, tenant, &model, gpus, start, term_days, payment, discount, &book,
            )
            .map_err(|e| match e {
                flotilla_billing::BillingError::Invalid { .. } => billing_field(e),
                other => ApiError::field(FieldError::new("model", other.to_string())),
            })?;
            st.store().add_commitment(&c, now).await?;
            serde_json::to_value(&c)
        }
        NewTerm::Discount {
            id,
            percent,
            scope,
            from,
            until,
        } => {
            term_id(&id)?;
            let d = Discount {
                id,
                tenant,
                percent,
                scope,
                from,
                until,
            };
            d.validate().map_err(billing_field)?;
            if until.is_some_and(|u| u <= from) {
                return Err(ApiError::field(FieldError::new(
                    "until",
                    "must be after from",
                )));
            }
            st.store().add_discount(&d, now).await?;
            serde_json::to_value(&d)
        }
        NewTerm::Credit {
            id,
            credit_kind,
            amount,
            granted_at,
            expires_at,
        } => {
            term_id(&id)?;
            if amount <= Decimal::ZERO {
                return Err(ApiError::field(FieldError::new(
                    "amount",
                    "must be positive",
                )));
            }
            let granted_at = granted_at.unwrap_or(now);
            if expires_at.is_some_and(|e| e <= granted_at) {
                return Err(ApiError::field(FieldError::new(
                    "expires_at",
                    "must be after granted_at",
                )));
            }
            let c = CreditGrant {
                id,
                tenant,
                kind: credit_kind,
                amount,
                granted_at,
                expires_at,
            };
            st.store().add_credit(&c, now).await?;
            serde_json::to_value(&c)
        }
    }
    .map_err(ApiError::internal)?;
    st.billing().budgets.touch([&touched]);
    Ok((StatusCode::CREATED, Json(stored)))
}
