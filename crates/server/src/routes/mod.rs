//! The `/v1` API. Routes are registered through utoipa-axum's
//! `OpenApiRouter`, so a route cannot exist without its OpenAPI entry.

use axum::Json;
use flotilla_core::api::Page;
use flotilla_core::FieldError;
use flotilla_store::{PageOf, PageReq};
use utoipa::openapi::security::{HttpAuthScheme, HttpBuilder, SecurityScheme};
use utoipa::{Modify, OpenApi};
use utoipa_axum::router::OpenApiRouter;
use utoipa_axum::routes;

use crate::error::ApiError;
use crate::extract::Pagination;
use crate::state::AppState;

pub mod agent;
pub mod budgets;
pub mod catalog;
pub mod docs;
pub mod endpoints;
pub mod export;
pub mod gateway;
pub mod instances;
pub mod invoices;
pub mod jobs;
pub mod keys;
pub mod nodepools;
pub mod nodes;
pub mod offers;
pub mod payouts;
pub mod pools;
pub mod prices;
pub mod registries;
pub mod telemetry;
pub mod tenants;
pub mod usage;
pub(crate) mod work;

#[derive(OpenApi)]
#[openapi(
    info(
        title = "Flotilla API",
        description = "Rent GPUs, run work on them, and operate the pool. Every request carries \
                       `Authorization: Bearer <api key>`. Errors share one body: \
                       `{\"error\": {\"code\", \"message\", \"details\"}}`; 422 and 400 name the \
                       field in `details.field`; another tenant's resources are 404; lists \
                       take `limit` and `cursor`; every POST honours `Idempotency-Key`."
    ),
    modifiers(&BearerAuth),
    security(("bearer" = [])),
    tags(
        (name = "tenants", description = "Tenants and quotas"),
        (name = "keys", description = "API keys"),
        (name = "catalog", description = "GPU models and free capacity"),
        (name = "nodes", description = "Machines offering GPUs"),
        (name = "instances", description = "GPU instances: rent, run, stop, logs"),
        (name = "jobs", description = "Batch and training jobs: gangs placed whole, restarts, queue"),
        (name = "agent", description = "Protocol of the node agent"),
        (name = "usage", description = "Metered usage and invoices"),
        (name = "billing", description = "Prices, invoices, terms, budgets, estimates and payouts"),
        (name = "pools", description = "Replica pools scaled by an autoscaling policy (superseded by endpoints)"),
        (name = "endpoints", description = "Serverless endpoints: replicas scaled from zero behind the gateway"),
        (name = "gateway", description = "Protocol of the inference gateway"),
        (name = "registries", description = "Tenants' logins to private container registries"),
        (name = "meta", description = "Identity and health"),
    )
)]
struct ApiDoc;

struct BearerAuth;

impl Modify for BearerAuth {
    fn modify(&self, openapi: &mut utoipa::openapi::OpenApi) {
        let components = openapi.components.get_or_insert_with(Default::default);
        components.add_security_scheme(
            "bearer",
            SecurityScheme::Http(HttpBuilder::new().scheme(HttpAuthScheme::Bearer).build()),
        );
    }
}

/// Every documented route, and the document describing them.
pub fn api() -> OpenApiRouter<AppState> {
    OpenApiRouter::with_openapi(ApiDoc::openapi())
        .routes(routes!(tenants::me))
        .routes(routes!(tenants::list_tenants, tenants::create_tenant))
        .routes(routes!(tenants::get_tenant))
        .routes(routes!(tenants::get_quota, tenants::set_quota))
        .routes(routes!(keys::list_keys, keys::create_key))
        .routes(routes!(keys::revoke_key))
        .routes(routes!(catalog::list_gpu_types))
        .routes(routes!(nodes::list_nodes))
        .routes(routes!(nodes::get_node))
        .routes(routes!(offers::get_offer, offers::set_offer))
        .routes(routes!(telemetry::instance_advice))
        .routes(routes!(telemetry::endpoint_advice))
        .routes(routes!(endpoints::get_vertical, endpoints::set_vertical))
        .routes(routes!(nodes::cordon_node))
        .routes(routes!(nodes::uncordon_node))
        .routes(routes!(nodes::drain_node))
        .routes(routes!(nodes::node_events))
        .routes(routes!(nodes::reset_gpu))
        .routes(routes!(pools::create_pool))
        .routes(routes!(pools::get_pool))
        .routes(routes!(pools::report_metrics))
        .routes(routes!(
            endpoints::list_endpoints,
            endpoints::create_endpoint
        ))
        .routes(routes!(
            endpoints::get_endpoint,
            endpoints::update_endpoint,
            endpoints::delete_endpoint
        ))
        .routes(routes!(endpoints::endpoint_logs))
        .routes(routes!(endpoints::report_metric))
        .routes(routes!(gateway::routes))
        .routes(routes!(gateway::authorize))
        .routes(routes!(gateway::signals))
        .routes(routes!(gateway::usage))
        .routes(routes!(
            instances::list_instances,
            instances::create_instance
        ))
        .routes(routes!(instances::list_queue))
        .routes(routes!(instances::get_instance))
        .routes(routes!(telemetry::instance_telemetry))
        .routes(routes!(instances::stop_instance))
        .routes(routes!(instances::instance_logs))
        .routes(routes!(jobs::list_jobs, jobs::create_job))
        .routes(routes!(jobs::job_queue))
        .routes(routes!(jobs::get_job))
        .routes(routes!(jobs::cancel_job))
        .routes(routes!(
            registries::list_registry_credentials,
            registries::create_registry_credential
        ))
        .routes(routes!(registries::delete_registry_credential))
        .routes(routes!(agent::register))
        .routes(routes!(nodepools::join))
        .routes(routes!(nodepools::list_node_pools))
        .routes(routes!(agent::sync))
        .routes(routes!(agent::push_logs))
        .routes(routes!(usage::post_usage_events))
        .routes(routes!(usage::list_usage))
        .routes(routes!(usage::invoice_preview))
        .merge(billing_routes())
}

/// Prices, invoices, billing terms, budgets, estimates and payouts.
fn billing_routes() -> OpenApiRouter<AppState> {
    OpenApiRouter::new()
        .routes(routes!(prices::get_prices, prices::publish_prices))
        .routes(routes!(prices::get_spot_prices))
        .routes(routes!(prices::post_estimate))
        .routes(routes!(invoices::list_invoices))
        .routes(routes!(invoices::get_invoice))
        .routes(routes!(invoices::finalize_invoices))
        .routes(routes!(invoices::get_terms, invoices::add_term))
        .routes(routes!(budgets::get_budget, budgets::set_budget))
        .routes(routes!(payouts::get_payouts))
}

/// A store page as an API page.
pub(crate) fn page<T>(p: PageOf<T>) -> Json<Page<T>> {
    Json(Page {
        items: p.items,
        next_cursor: p.next,
    })
}

/// The store's page request for `?limit&cursor`.
pub(crate) fn page_req(p: &Pagination) -> PageReq {
    PageReq::new(p.cursor.clone(), p.limit)
}

/// A path id, parsed or a 400 naming the parameter.
pub(crate) fn path_id<T>(
    raw: &str,
    field: &str,
    parse: impl Fn(&str, &str) -> Result<T, FieldError>,
) -> Result<T, ApiError> {
    parse(raw, field).map_err(|e| ApiError::bad_request(field, e.message))
}
