//! Calendar windows: a fixed window that starts at the top of the hour, at midnight or on the
//! 1st of the month in a time zone, rather than at a multiple of its length since the epoch.
//! Invariant: [`Calendar::window`] returns `start <= t < end` with `end - start` at most
//! [`Calendar::longest`] (a day has 23, 24 or 25 hours; a month 28 to 31 days, ±1 hour).
//!
//! Time-zone rules come from the tz database bundled with `jiff`, so the answer does not
//! depend on the host's `/usr/share/zoneinfo`. Only the start and end of a window are zoned;
//! the algorithms still count in µs since the epoch.

use std::fmt;
use std::hash::{Hash, Hasher};

use jiff::tz::TimeZone;

use super::{NonZeroSpan, Span, Timestamp};

const HOUR: u64 = 3_600_000_000;

/// The length of a calendar window.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum CalendarUnit {
    Hour,
    Day,
    Month,
}

/// Windows aligned to `unit` boundaries in one time zone.
#[derive(Clone, Debug)]
pub struct Calendar {
    /// As written (`utc`, `Europe/Berlin`), for messages and equality.
    zone_name: Box<str>,
    unit: CalendarUnit,
    tz: TimeZone,
}

impl PartialEq for Calendar {
    fn eq(&self, other: &Self) -> bool {
        self.zone_name == other.zone_name && self.unit == other.unit
    }
}

impl Eq for Calendar {}

impl Hash for Calendar {
    fn hash<H: Hasher>(&self, h: &mut H) {
        self.zone_name.hash(h);
        self.unit.hash(h);
    }
}

impl fmt::Display for Calendar {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let unit = match self.unit {
            CalendarUnit::Hour => "hour",
            CalendarUnit::Day => "day",
            CalendarUnit::Month => "month",
        };
        write!(f, "{unit} in {}", self.zone_name)
    }
}

impl Calendar {
    /// The zone as configured (`utc` or an IANA name).
    pub fn zone(&self) -> &str {
        &self.zone_name
    }

    /// `zone` is `utc` (any case) or an IANA time zone name.
    ///
    /// # Errors
    /// A sentence for the user when the zone is unknown.
    pub fn new(zone: &str, unit: CalendarUnit) -> Result<Calendar, String> {
        let tz = if zone.eq_ignore_ascii_case("utc") {
            TimeZone::UTC
        } else {
            TimeZone::get(zone).map_err(|_| {
                format!(
                    "`{}` is not a time zone; expected `utc` or an IANA name such as Europe/Berlin",
                    zone.escape_debug()
                )
            })?
        };
        Ok(Calendar { zone_name: zone.into(), unit, tz })
    }

    pub fn unit(&self) -> CalendarUnit {
        self.unit
    }

    /// The longest window of this unit (DST days have 25 hours, months 31 days and one hour).
    pub fn longest(&self) -> NonZeroSpan {
        let us = match self.unit {
            CalendarUnit::Hour => HOUR,
            CalendarUnit::Day => 25 * HOUR,
            CalendarUnit::Month => (31 * 24 + 1) * HOUR,
        };
        NonZeroSpan::from_micros(us).unwrap_or(NonZeroSpan::MIN)
    }

    /// The window holding `t`: `(start, end)` with `start <= t < end`. Outside the range the
    /// zone rules cover (years before -9999 or after 9999) it falls back to windows of
    /// [`Calendar::longest`] aligned to the epoch, which still satisfy the invariant.
    pub fn window(&self, t: Timestamp) -> (Timestamp, Timestamp) {
        self.zoned_window(t).unwrap_or_else(|| {
            let w = self.longest();
            let start = t.floor(w);
            (start, start + w.get())
        })
    }

    fn zoned_window(&self, t: Timestamp) -> Option<(Timestamp, Timestamp)> {
        let us = i64::try_from(t.as_micros()).ok()?;
        let zoned = jiff::Timestamp::from_microsecond(us).ok()?.to_zoned(self.tz.clone());
        let (start, end) = match self.unit {
            // Offsets are not always whole hours (India, Nepal): the hour is the local one,
            // and always 3600 s long.
            CalendarUnit::Hour => {
                let offset_us = i64::from(zoned.offset().seconds()) * 1_000_000;
                let into = (us + offset_us).rem_euclid(HOUR as i64);
                let start = us - into;
                (start, start + HOUR as i64)
            }
            CalendarUnit::Day => {
                let day = zoned.date();
                (micros(&day, &self.tz)?, micros(&day.tomorrow().ok()?, &self.tz)?)
            }
            CalendarUnit::Month => {
                let first = zoned.date().first_of_month();
                let next = first.checked_add(jiff::Span::new().months(1)).ok()?;
                (micros(&first, &self.tz)?, micros(&next, &self.tz)?)
            }
        };
        let (start, end) = (u64::try_from(start).ok()?, u64::try_from(end).ok()?);
        (start <= t.as_micros() && t.as_micros() < end)
            .then(|| (Timestamp::from_micros(start), Timestamp::from_micros(end)))
    }

    /// The time from `t` to the end of its window.
    pub fn left(&self, t: Timestamp) -> Span {
        self.window(t).1 - t
    }
}

/// The first instant of `day` in `tz` (after the gap when midnight does not exist there), µs.
fn micros(day: &jiff::civil::Date, tz: &TimeZone) -> Option<i64> {
    let start = day.to_zoned(tz.clone()).ok()?.start_of_day().ok()?;
    Some(start.timestamp().as_microsecond())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// µs of an RFC 3339 instant.
    fn t(s: &str) -> Timestamp {
        let ts: jiff::Timestamp = s.parse().expect("instant");
        Timestamp::from_micros(u64::try_from(ts.as_microsecond()).expect("after 1970"))
    }

    #[test]
    fn months_have_their_own_lengths() {
        let c = Calendar::new("utc", CalendarUnit::Month).expect("utc");
        assert_eq!(c.window(t("2026-02-14T10:00:00Z")), (t("2026-02-01T00:00:00Z"), t("2026-03-01T00:00:00Z")));
        assert_eq!(c.window(t("2028-02-29T23:59:59Z")), (t("2028-02-01T00:00:00Z"), t("2028-03-01T00:00:00Z")));
        assert_eq!(c.window(t("2026-12-31T23:59:59.999999Z")).1, t("2027-01-01T00:00:00Z"));
        assert_eq!(c.window(t("2027-01-01T00:00:00Z")).0, t("2027-01-01T00:00:00Z"));
    }

    #[test]
    fn days_in_a_zone_have_23_or_25_hours_around_dst() {
        let c = Calendar::new("Europe/Berlin", CalendarUnit::Day).expect("zone");
        // 2026-03-29: clocks go 02:00 → 03:00 CET → CEST.
        let (s, e) = c.window(t("2026-03-29T12:00:00+02:00"));
        assert_eq!((s, e), (t("2026-03-29T00:00:00+01:00"), t("2026-03-30T00:00:00+02:00")));
        assert_eq!((e - s).as_micros(), 23 * HOUR);
        // 2026-10-25: 03:00 CEST → 02:00 CET.
        let (s, e) = c.window(t("2026-10-25T12:00:00+01:00"));
        assert_eq!((e - s).as_micros(), 25 * HOUR);
        assert!(e - s <= c.longest().get());
    }

    #[test]
    fn hours_follow_the_local_offset() {
        let c = Calendar::new("Asia/Kolkata", CalendarUnit::Hour).expect("zone");
        assert_eq!(
            c.window(t("2026-06-01T10:20:00+05:30")),
            (t("2026-06-01T10:00:00+05:30"), t("2026-06-01T11:00:00+05:30"))
        );
    }

    #[test]
    fn month_in_a_zone_starts_at_local_midnight() {
        let c = Calendar::new("America/New_York", CalendarUnit::Month).expect("zone");
        // 03:00 UTC on the 1st is still the previous month in New York.
        let (s, e) = c.window(t("2026-11-01T03:00:00Z"));
        assert_eq!((s, e), (t("2026-10-01T00:00:00-04:00"), t("2026-11-01T00:00:00-04:00")));
        assert_eq!(c.left(t("2026-10-31T23:00:00-04:00")).as_micros(), HOUR);
    }

    #[test]
    fn unknown_zone_is_refused() {
        assert!(Calendar::new("Mars/Olympus", CalendarUnit::Day).is_err());
        assert!(Calendar::new("UTC", CalendarUnit::Day).is_ok());
    }

    #[test]
    fn far_times_fall_back_to_aligned_windows() {
        let c = Calendar::new("utc", CalendarUnit::Month).expect("utc");
        let (s, e) = c.window(Timestamp::MAX - Span::from_micros(1));
        assert!(s <= Timestamp::MAX - Span::from_micros(1) && e - s <= c.longest().get());
    }
}
