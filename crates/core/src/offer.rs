//! A provider's offer: when a node's GPUs are offered to tenants (weekly
//! time windows, UTC). Pure: the server reads the offer and the clock and asks these
//! functions; the scheduler then sees a node outside its windows as
//! unavailable, and the reconciler stops work on a node whose window has
//! closed.

use chrono::{DateTime, Datelike, Duration, Timelike, Utc};
use serde::{Deserialize, Serialize};

use crate::FieldError;

/// Days as windows name them, Monday first.
pub const DAYS: [&str; 7] = ["mon", "tue", "wed", "thu", "fri", "sat", "sun"];
/// Most windows one node may have.
pub const MAX_WINDOWS: usize = 64;
/// How long before a window closes its work is told to stop: here, not in
/// the server, because the provider's page says it too.
pub const NOTICE: Duration = Duration::minutes(2);

/// A weekly window, UTC: `start` to `end` (`HH:MM`, 24 h; an `end` at or
/// before `start` runs past midnight) on `days` (`mon`…`sun`; empty:
/// every day; the day is the one the window opens on).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, utoipa::ToSchema)]
#[serde(deny_unknown_fields)]
pub struct OfferWindow {
    /// Days the window opens on.
    #[serde(default)]
    pub days: Vec<String>,
    /// Opening time, `HH:MM` UTC.
    pub start: String,
    /// Closing time, `HH:MM` UTC.
    pub end: String,
}

/// What a provider offers of one node.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize, utoipa::ToSchema)]
#[serde(deny_unknown_fields)]
pub struct NodeOffer {
    /// When its GPUs are offered; empty: always.
    #[serde(default)]
    pub windows: Vec<OfferWindow>,
}

/// Minutes after midnight of `HH:MM`.
pub(crate) fn minutes(s: &str) -> Option<u32> {
    let (h, m) = s.split_once(':')?;
    let (h, m) = (h.parse::<u32>().ok()?, m.parse::<u32>().ok()?);
    (h < 24 && m < 60 && s.len() == 5).then_some(h * 60 + m)
}

/// Whether a weekly window (`days`, empty: every day; `start` to `end`,
/// `HH:MM`, an `end` at or before `start` running past midnight) is open
/// at minute `at` of weekday `today` (0: Monday), on the clock the window
/// is written in. One reading for provider offers and endpoint schedules,
/// so a window means the same wherever it is written.
pub(crate) fn window_open(days: &[String], start: &str, end: &str, today: usize, at: u32) -> bool {
    let yesterday = (today + 6) % 7;
    let on = |day: usize| days.is_empty() || days.iter().any(|d| d.eq_ignore_ascii_case(DAYS[day]));
    let (Some(start), Some(end)) = (minutes(start), minutes(end)) else {
        return false;
    };
    if start < end {
        on(today) && (start..end).contains(&at)
    } else {
        // Past midnight: the evening part today, the morning part
        // belongs to the window that opened yesterday.
        (on(today) && at >= start) || (on(yesterday) && at < end)
    }
}

impl NodeOffer {
    /// Checks the offer; errors name the field (`windows[1].start`).
    pub fn validate(&self) -> Result<(), FieldError> {
        if self.windows.len() > MAX_WINDOWS {
            return Err(FieldError::new(
                "windows",
                format!("at most {MAX_WINDOWS} windows"),
            ));
        }
        for (i, w) in self.windows.iter().enumerate() {
            for (f, v) in [("start", &w.start), ("end", &w.end)] {
                if minutes(v).is_none() {
                    return Err(FieldError::new(
                        format!("windows[{i}].{f}"),
                        format!("must be a time HH:MM (UTC), got `{v}`"),
                    ));
                }
            }
            if w.start == w.end {
                return Err(FieldError::new(
                    format!("windows[{i}].end"),
                    "must differ from start (leave windows empty to offer always)",
                ));
            }
            for (j, d) in w.days.iter().enumerate() {
                if !DAYS.contains(&d.to_ascii_lowercase().as_str()) {
                    return Err(FieldError::new(
                        format!("windows[{i}].days[{j}]"),
                        format!("must be one of {}, got `{d}`", DAYS.join(", ")),
                    ));
                }
            }
        }
        Ok(())
    }

    /// Whether the node's GPUs are offered at `now`.
    pub fn offered_at(&self, now: DateTime<Utc>) -> bool {
        if self.windows.is_empty() {
            return true;
        }
        let at = now.hour() * 60 + now.minute();
        let today = now.weekday().num_days_from_monday() as usize;
        self.windows
            .iter()
            .any(|w| window_open(&w.days, &w.start, &w.end, today, at))
    }

    /// When the offer next stops, if it stops within `horizon` of `now`
    /// while offered now (to the minute): what the notice to running work
    /// names. `None` when not offered now, or offered throughout.
    pub fn closes_within(&self, now: DateTime<Utc>, horizon: Duration) -> Option<DateTime<Utc>> {
        if !self.offered_at(now) {
            return None;
        }
        let start = now.with_second(0)?.with_nanosecond(0)?;
        let mut t = start + Duration::minutes(1);
        while t <= now + horizon {
            if !self.offered_at(t) {
                return Some(t);
            }
            t += Duration::minutes(1);
        }
        None
    }

    /// When the offer next opens, if it is closed at `now`: the first
    /// window start after `now` (to the minute), within a week. `None`
    /// when offered now or when no window ever opens. What the scheduler
    /// plans its next pass for while work waits for this node.
    pub fn opens_after(&self, now: DateTime<Utc>) -> Option<DateTime<Utc>> {
        if self.offered_at(now) {
            return None;
        }
        let midnight = now.date_naive().and_hms_opt(0, 0, 0)?.and_utc();
        let today = now.weekday().num_days_from_monday() as usize;
        let mut first: Option<DateTime<Utc>> = None;
        for w in &self.windows {
            let Some(start) = minutes(&w.start) else {
                continue;
            };
            // Today's start may still be ahead; a week on, the same day's
            // start always is.
            for ahead in 0..=7usize {
                let day = (today + ahead) % 7;
                let on =
                    w.days.is_empty() || w.days.iter().any(|d| d.eq_ignore_ascii_case(DAYS[day]));
                let at =
                    midnight + Duration::days(ahead as i64) + Duration::minutes(i64::from(start));
                if on && at > now {
                    first = Some(first.map_or(at, |f| f.min(at)));
                    break;
                }
            }
        }
        first
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use chrono::TimeZone;

    fn w(days: &[&str], start: &str, end: &str) -> OfferWindow {
        OfferWindow {
            days: days.iter().map(|d| d.to_string()).collect(),
            start: start.into(),
            end: end.into(),
        }
    }

    fn at(d: u32, h: u32, m: u32) -> DateTime<Utc> {
        // 2026-11-30 is a Monday; day 1 is that Monday.
        Utc.with_ymd_and_hms(2026, 11, 30, h, m, 0).unwrap() + Duration::days(i64::from(d) - 1)
    }

    #[test]
    fn a_closed_offer_names_when_it_next_opens() {
        let o = NodeOffer {
            windows: vec![w(&["mon"], "22:00", "06:00"), w(&["wed"], "12:00", "13:00")],
        };
        // Monday noon: tonight at ten.
        assert_eq!(o.opens_after(at(1, 12, 0)), Some(at(1, 22, 0)));
        // Open now: nothing to wait for.
        assert_eq!(o.opens_after(at(1, 23, 0)), None);
        // Tuesday at seven: Wednesday noon, before next Monday's window.
        assert_eq!(o.opens_after(at(2, 7, 0)), Some(at(3, 12, 0)));
        // Wednesday at 13:30: next Monday evening.
        assert_eq!(o.opens_after(at(3, 13, 30)), Some(at(8, 22, 0)));
        // Seconds before the start: that start.
        assert_eq!(
            o.opens_after(at(1, 21, 59) + Duration::seconds(30)),
            Some(at(1, 22, 0))
        );
        assert_eq!(NodeOffer::default().opens_after(at(1, 3, 0)), None);
    }

    #[test]
    fn no_windows_means_always_offered() {
        let o = NodeOffer::default();
        assert!(o.offered_at(at(1, 3, 0)));
        assert_eq!(o.closes_within(at(1, 3, 0), Duration::hours(24)), None);
    }

    #[test]
    fn windows_open_on_their_days_and_past_midnight() {
        let o = NodeOffer {
            windows: vec![w(&["mon"], "22:00", "06:00"), w(&[], "12:00", "13:00")],
        };
        assert!(o.offered_at(at(1, 23, 0)), "monday evening");
        assert!(o.offered_at(at(2, 5, 59)), "tuesday morning, opened monday");
        assert!(!o.offered_at(at(2, 6, 0)), "closed at six");
        assert!(!o.offered_at(at(2, 23, 0)), "not on tuesday evening");
        assert!(o.offered_at(at(3, 12, 30)), "every day at noon");
        assert!(!o.offered_at(at(3, 13, 0)));
    }

    #[test]
    fn the_closing_time_is_found_within_the_horizon() {
        let o = NodeOffer {
            windows: vec![w(&[], "09:00", "17:00")],
        };
        assert_eq!(
            o.closes_within(at(1, 16, 50), Duration::minutes(15)),
            Some(at(1, 17, 0))
        );
        assert_eq!(o.closes_within(at(1, 15, 0), Duration::minutes(15)), None);
        assert_eq!(o.closes_within(at(1, 18, 0), Duration::minutes(15)), None);
    }

    #[test]
    fn offers_are_validated_by_field() {
        let bad = |o: NodeOffer| o.validate().unwrap_err().field;
        assert_eq!(
            bad(NodeOffer {
                windows: vec![w(&[], "9:00", "17:00")]
            }),
            "windows[0].start"
        );
        assert_eq!(
            bad(NodeOffer {
                windows: vec![w(&["xyz"], "09:00", "17:00")]
            }),
            "windows[0].days[0]"
        );
        assert_eq!(
            bad(NodeOffer {
                windows: vec![w(&[], "09:00", "09:00")]
            }),
            "windows[0].end"
        );
        assert!(NodeOffer {
            windows: vec![w(&["sat", "SUN"], "00:00", "23:59")]
        }
        .validate()
        .is_ok());
    }
}
