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

pub mod access;
pub mod agent;
pub mod audit;
pub mod budgets;
pub mod catalog;
pub mod docs;
pub mod endpoints;
pub mod export;
pub mod gateway;
pub mod history;
pub mod instances;
pub mod invoices;
pub mod jobs;
pub mod keys;
pub mod kinds;
pub mod nodepools;
pub mod nodes;
pub mod offers;
pub mod payouts;
pub mod prices;
pub mod reconcile;
pub mod registries;
pub mod ssh_keys;
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
        (name = "endpoints", description = "Serverless endpoints: replicas scaled from zero behind the gateway"),
        (name = "gateway", description = "Protocol of the inference gateway"),
        (name = "registries", description = "Tenants' logins to private container registries"),
        (name = "ssh", description = "Tenants' SSH public keys, for `flotilla ssh` into running instances"),
        (name = "audit", description = "Who changed what, when, and how it ended"),
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

/// Documents the answers every route may give besides its own: those of
/// the layers in front of every handler (authentication and its rate
/// limits, the idempotency layer) and of the extractors (a query, path or
/// body that cannot be read). Added here once, so that no route's entry can
/// leave them out; an entry that documents one itself keeps its own text.
pub struct CommonResponses;

impl Modify for CommonResponses {
    fn modify(&self, openapi: &mut utoipa::openapi::OpenApi) {
        use utoipa::openapi::header::HeaderBuilder;
        use utoipa::openapi::{ContentBuilder, Ref, ResponseBuilder, Type};

        let error = |description: &str| {
            ResponseBuilder::new().description(description).content(
                "application/json",
                ContentBuilder::new()
                    .schema(Some(Ref::from_schema_name("ErrorBody")))
                    .build(),
            )
        };
        for (path, item) in openapi.paths.paths.iter_mut() {
            let ops = [
                (false, item.get.as_mut()),
                (true, item.put.as_mut()),
                (true, item.post.as_mut()),
                (true, item.delete.as_mut()),
                (true, item.patch.as_mut()),
            ];
            for (mutating, op) in ops {
                let Some(op) = op else { continue };
                let has_body = op.request_body.is_some();
                let has_params = op.parameters.as_ref().is_some_and(|p| !p.is_empty());
                let mut add = |status: &str, response: utoipa::openapi::Response| {
                    op.responses
                        .responses
                        .entry(status.to_string())
                        .or_insert(response.into());
                };
                add(
                    "401",
                    error(
                        "no `Authorization: Bearer <api key>` header, or an unknown or revoked key",
                    )
                    .build(),
                );
                add(
                    "403",
                    error("the key's role may not do this (or it is an inference key, which works at the gateway only)").build(),
                );
                add(
                    "429",
                    error(
                        "too many requests for this key, or without a valid key from this address",
                    )
                    .header(
                        "Retry-After",
                        HeaderBuilder::new()
                            .schema(
                                utoipa::openapi::ObjectBuilder::new().schema_type(Type::Integer),
                            )
                            .description(Some("seconds to wait before retrying"))
                            .build(),
                    )
                    .build(),
                );
                if has_params || has_body || mutating {
                    add(
                        "400",
                        error("a query, path parameter, header or body that cannot be read; `details.field` names it").build(),
                    );
                }
                if path.contains('{') {
                    add("404", error("not found, or another tenant's").build());
                }
                if has_body {
                    add("413", error("the body is larger than the limit").build());
                }
                if has_body || mutating {
                    add(
                        "422",
                        error("a value is wrong, or the Idempotency-Key was used with another request; `details.field` names it").build(),
                    );
                }
                if mutating {
                    add(
                        "409",
                        error("the object's state forbids the change, or a request with this Idempotency-Key is still being handled").build(),
                    );
                }
            }
        }
    }
}

/// Every documented route and the document describing them, whole: with
/// the answers every route may give ([`CommonResponses`], applied once the
/// routes are in).
pub fn documented() -> (axum::Router<AppState>, utoipa::openapi::OpenApi) {
    let (router, mut doc) = api().split_for_parts();
    CommonResponses.modify(&mut doc);
    (router, doc)
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
        .routes(routes!(audit::list_audit))
        .routes(routes!(catalog::list_gpu_types))
        .routes(routes!(history::demand))
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
        .routes(routes!(access::exec))
        .routes(routes!(access::port_forward))
        .routes(routes!(access::ssh))
        .routes(routes!(access::agent_session))
        .routes(routes!(jobs::list_jobs, jobs::create_job))
        .routes(routes!(jobs::job_queue))
        .routes(routes!(jobs::get_job))
        .routes(routes!(jobs::cancel_job))
        .routes(routes!(
            registries::list_registry_credentials,
            registries::create_registry_credential
        ))
        .routes(routes!(registries::delete_registry_credential))
        .routes(routes!(ssh_keys::list_ssh_keys, ssh_keys::create_ssh_key))
        .routes(routes!(ssh_keys::delete_ssh_key))
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
        .routes(routes!(invoices::finalise_invoices))
        .routes(routes!(invoices::get_terms, invoices::add_term))
        .routes(routes!(budgets::get_budget, budgets::set_budget))
        .routes(routes!(payouts::get_payouts))
        .routes(routes!(reconcile::get_reconcile))
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
