//! The operator's replay page: this cluster's own recorded demand
//! (`Client::demand_history`) replayed through the scheduling pass by
//! `flotilla_sim::history`, the code `flotilla simulate --from-history`
//! runs, beside what actually happened. The operator picks the window, a
//! placement policy and a pool scaled up or down; the page shows GPU-hours,
//! waits, preemptions and cost to tenants for the record, the replay under
//! the recorded settings (which shows how faithful the replay is) and the
//! replay under the changed ones, with a sentence for what moved.

use axum::extract::{Query, State};
use axum::response::Response;
use axum::routing::get;
use axum::Router;
use chrono::{DateTime, Duration, Utc};
use flotilla_sched::Policy;
use flotilla_sim::history::{self, Outcome, ReplaySettings};
use maud::{html, Markup};
use serde::Deserialize;

use super::session::Session;
use super::{page, table, ConsoleError, ConsoleResult, ConsoleState};

pub(super) fn routes() -> Router<ConsoleState> {
    Router::new().route("/replay", get(replay))
}

/// The form, as its query string: every field optional, the defaults are
/// the last day, the server's own policy and the pool as it is.
#[derive(Debug, Default, Deserialize)]
pub(super) struct ReplayQuery {
    from: Option<String>,
    to: Option<String>,
    policy: Option<String>,
    node_scale: Option<String>,
}

/// What the operator asked for, checked.
#[derive(Debug, PartialEq)]
struct Asked {
    from: DateTime<Utc>,
    to: DateTime<Utc>,
    policy: Option<Policy>,
    scale: f64,
}

fn instant(raw: Option<&str>, field: &'static str) -> Result<Option<DateTime<Utc>>, ConsoleError> {
    match raw.map(str::trim).filter(|s| !s.is_empty()) {
        None => Ok(None),
        Some(s) => DateTime::parse_from_rfc3339(s)
            .map(|t| Some(t.with_timezone(&Utc)))
            .map_err(|_| ConsoleError::field(field, format!("`{s}` is not an RFC 3339 time"))),
    }
}

fn asked(q: &ReplayQuery, now: DateTime<Utc>) -> Result<Asked, ConsoleError> {
    let to = instant(q.to.as_deref(), "to")?.unwrap_or(now);
    let from = instant(q.from.as_deref(), "from")?.unwrap_or(to - Duration::days(1));
    if from >= to {
        return Err(ConsoleError::field("to", "must be after `from`"));
    }
    let policy = match q.policy.as_deref().map(str::trim).filter(|s| !s.is_empty()) {
        None => None,
        Some(name) => Some(history::parse_policy(name).ok_or_else(|| {
            ConsoleError::field(
                "policy",
                format!(
                    "unknown policy `{name}`; one of {}",
                    Policy::ALL.map(|p| p.name()).join(", ")
                ),
            )
        })?),
    };
    let scale = match q
        .node_scale
        .as_deref()
        .map(str::trim)
        .filter(|s| !s.is_empty())
    {
        None => 1.0,
        Some(s) => s
            .parse::<f64>()
            .ok()
            .filter(|f| f.is_finite() && *f > 0.0 && *f <= 100.0)
            .ok_or_else(|| {
                ConsoleError::field("node_scale", "must be a number above 0, e.g. 0.5 for half")
            })?,
    };
    Ok(Asked {
        from,
        to,
        policy,
        scale,
    })
}

async fn replay(
    State(st): State<ConsoleState>,
    s: Session,
    Query(q): Query<ReplayQuery>,
) -> ConsoleResult<Response> {
    super::operator::require_operator(&s).await?;
    let a = asked(&q, st.now())?;
    let h = s.api.demand_history(a.from, a.to).await?;
    let server_policy = history::parse_policy(&h.placement_policy).unwrap_or(Policy::Flotilla);
    let policy = a.policy.unwrap_or(server_policy);
    // A replay of a busy month is seconds of CPU: off the request threads.
    let scale = a.scale;
    let (recorded, same, changed) = tokio::task::spawn_blocking(move || {
        let recorded = history::recorded(&h);
        let same = history::replay(
            &h,
            &ReplaySettings {
                policy: server_policy,
                nodes: h.nodes.clone(),
            },
        )?;
        let nodes = history::scale_nodes(&h.nodes, scale);
        let n = nodes.len();
        let changed = if policy != server_policy || scale != 1.0 {
            Some((n, history::replay(&h, &ReplaySettings { policy, nodes })?))
        } else {
            None
        };
        Ok::<_, history::ReplayError>((recorded, same, (h.nodes.len(), changed)))
    })
    .await
    .map_err(ConsoleError::internal)?
    .map_err(ConsoleError::internal)?;
    let (pool, changed) = changed;
    let mut columns = vec![
        ("Recorded".to_string(), &recorded),
        (
            format!("Replay: {}, {pool} nodes", server_policy.name()),
            &same,
        ),
    ];
    let said = changed
        .as_ref()
        .map(|(_, c)| history::differences(&recorded, c))
        .unwrap_or_default();
    if let Some((n, c)) = &changed {
        columns.push((format!("Replay: {}, {n} nodes", policy.name()), c));
    }
    let body = html! {
        (form(&a, policy))
        (comparison(&columns))
        @if !said.is_empty() {
            ul.said { @for line in &said { li { (line) } } }
        }
        p.muted {
            "The replay places every instance and job submitted in the window through the \
             scheduling pass the server runs, on a virtual clock, each running as long as it \
             ran; cost is at the list on-demand price. The same from the command line: "
            code { "flotilla simulate --from-history FROM..TO" }
        }
    };
    Ok(page(&s, "Replay this cluster's demand", "/replay", body))
}

fn form(a: &Asked, policy: Policy) -> Markup {
    let stamp = |t: &DateTime<Utc>| t.to_rfc3339_opts(chrono::SecondsFormat::Secs, true);
    html! {
        form.inline method="get" action="/replay" {
            label { "From " input name="from" value=(stamp(&a.from)); }
            label { "To " input name="to" value=(stamp(&a.to)); }
            label { "Placement policy "
                select name="policy" {
                    @for p in Policy::ALL {
                        option value=(p.name()) selected[p == policy] { (p.name()) }
                    }
                }
            }
            label { "Nodes × " input name="node_scale" value=(a.scale) size="4"; }
            button type="submit" { "Replay" }
        }
    }
}

fn comparison(columns: &[(String, &Outcome)]) -> Markup {
    type Cell = fn(&Outcome) -> String;
    let rows: [(&str, Cell); 8] = [
        ("Works", |o| o.works.to_string()),
        ("Never ran", |o| o.never_ran.to_string()),
        ("GPU-hours", |o| format!("{:.2}", o.gpu_hours)),
        ("Mean wait (s)", |o| format!("{:.1}", o.mean_wait_s)),
        ("p95 wait (s)", |o| format!("{:.1}", o.p95_wait_s)),
        ("Longest wait (s)", |o| format!("{:.1}", o.max_wait_s)),
        ("Preemptions", |o| o.preemptions.to_string()),
        ("Cost to tenants", |o| {
            format!("{} {}", o.cost.round_dp(2), o.currency)
        }),
    ];
    let mut headers = vec![""];
    headers.extend(columns.iter().map(|(name, _)| name.as_str()));
    let body = rows
        .iter()
        .map(|(label, cell)| {
            html! { tr {
                th scope="row" { (label) }
                @for (_, o) in columns { td.num { (cell(o)) } }
            } }
        })
        .collect();
    table(
        "What happened, and the replays",
        &headers,
        body,
        "Nothing was submitted in this window",
    )
}

#[cfg(test)]
mod tests {
    use chrono::TimeZone;

    use super::*;

    fn q(from: &str, to: &str, policy: &str, scale: &str) -> ReplayQuery {
        let s = |v: &str| (!v.is_empty()).then(|| v.to_string());
        ReplayQuery {
            from: s(from),
            to: s(to),
            policy: s(policy),
            node_scale: s(scale),
        }
    }

    #[test]
    fn the_form_defaults_to_the_last_day_and_names_a_bad_field() {
        let now = Utc.with_ymd_and_hms(2026, 12, 2, 0, 0, 0).unwrap();
        let a = asked(&q("", "", "", ""), now).unwrap();
        assert_eq!(
            (a.from, a.to, a.policy, a.scale),
            (now - Duration::days(1), now, None, 1.0)
        );
        let a = asked(&q("2026-12-01T06:00:00Z", "", "BestFit", "0.5"), now).unwrap();
        assert_eq!(a.policy, Some(Policy::BestFit));
        assert_eq!(a.scale, 0.5);
        for (query, field) in [
            (q("yesterday", "", "", ""), "from"),
            (
                q("2026-12-02T00:00:00Z", "2026-12-01T00:00:00Z", "", ""),
                "to",
            ),
            (q("", "", "Tetris", ""), "policy"),
            (q("", "", "", "-1"), "node_scale"),
            (q("", "", "", "NaN"), "node_scale"),
        ] {
            match asked(&query, now) {
                Err(ConsoleError::Field { field: f, .. }) => assert_eq!(f, field, "{query:?}"),
                other => panic!("{query:?}: {other:?}"),
            }
        }
    }

    #[test]
    fn the_comparison_has_a_column_per_outcome() {
        let o = Outcome {
            works: 3,
            ran: 3,
            never_ran: 0,
            gpu_hours: 4.5,
            mean_wait_s: 12.0,
            p95_wait_s: 30.0,
            max_wait_s: 30.0,
            preemptions: 1,
            cost: rust_decimal::Decimal::new(1234, 2),
            currency: "USD".into(),
        };
        let html = comparison(&[
            ("Recorded".into(), &o),
            ("Replay: BestFit, 2 nodes".into(), &o),
        ])
        .into_string();
        assert!(html.contains("Replay: BestFit, 2 nodes"), "{html}");
        assert!(html.contains("4.50"), "{html}");
        assert!(html.contains("12.34 USD"), "{html}");
    }
}
