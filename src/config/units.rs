//! Human units in the YAML: durations (`250ms`, `2s`, `5m`) and rates (`100/s`, `1000/60s`).
//!
//! Both parse from strings only, so a typo is reported at the value's own line and column.

use std::fmt;
use std::time::Duration;

use serde::de::{self, Deserializer, Visitor};
use serde::Deserialize;

/// A duration written as an integer (or decimal) and a unit: `us`, `ms`, `s`, `m`, `h`, `d`.
/// A bare `0` is allowed.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Dur(pub Duration);

/// A rate: `quantity` per `period`. `100/s`, `5/m`, `1000/60s`, `10/1.5s`, `1000/month`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Rate {
    pub quantity: u64,
    pub period: Duration,
    /// Written per `month`: the period is [`MONTH`] unless a calendar gives months their length.
    pub month: bool,
}

/// A month outside a calendar: 30 days.
pub const MONTH: Duration = Duration::from_secs(30 * 86_400);

/// A byte size: a whole number with an optional unit `B`, `KB`/`KiB`, `MB`/`MiB`, `GB`/`GiB`
/// (the decimal and binary spellings both mean powers of 1024, as in nginx).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Size(pub u64);

const SIZE_EXPECTED: &str = "a size such as 65536, 512KiB, 64MiB or 1GiB";

impl Size {
    pub fn parse(s: &str) -> Result<Size, String> {
        let s = s.trim();
        let split = s.find(|c: char| !c.is_ascii_digit()).unwrap_or(s.len());
        let (num, unit) = s.split_at(split);
        let n: u64 = num.parse().map_err(|_| format!("`{s}` is not a size; expected {SIZE_EXPECTED}"))?;
        let mult: u64 = match unit.trim().to_ascii_lowercase().as_str() {
            "" | "b" => 1,
            "k" | "kb" | "kib" => 1 << 10,
            "m" | "mb" | "mib" => 1 << 20,
            "g" | "gb" | "gib" => 1 << 30,
            other => return Err(format!("unknown size unit `{other}`; expected {SIZE_EXPECTED}")),
        };
        n.checked_mul(mult).map(Size).ok_or_else(|| format!("`{s}` is too large"))
    }
}

impl<'de> Deserialize<'de> for Size {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let s = d.deserialize_any(StrVisitor(SIZE_EXPECTED))?;
        Size::parse(&s).map_err(de::Error::custom)
    }
}

const DURATION_EXPECTED: &str = "a duration such as 250ms, 2s, 5m, 1h (units: us, ms, s, m, h, d)";
const RATE_EXPECTED: &str =
    "a rate such as 100/s, 5/m, 1000/h, 1000/d, 1000/month or 1000/60s (a whole number, a slash, a unit or duration)";

impl Dur {
    pub fn parse(s: &str) -> Result<Dur, String> {
        let s = s.trim();
        if s == "0" {
            return Ok(Dur(Duration::ZERO));
        }
        let split = s
            .find(|c: char| !(c.is_ascii_digit() || c == '.'))
            .ok_or_else(|| format!("`{s}` has no unit; expected {DURATION_EXPECTED}"))?;
        let (num, unit) = s.split_at(split);
        let nanos_per_unit: u128 = match unit.trim() {
            "us" | "µs" => 1_000,
            "ms" => 1_000_000,
            "s" => 1_000_000_000,
            "m" => 60 * 1_000_000_000,
            "h" => 3_600 * 1_000_000_000,
            "d" => 86_400 * 1_000_000_000,
            other => return Err(format!("unknown unit `{other}` in `{s}`; expected {DURATION_EXPECTED}")),
        };
        let nanos = scaled(num, nanos_per_unit)
            .ok_or_else(|| format!("`{s}` is not a number followed by a unit; expected {DURATION_EXPECTED}"))?;
        let nanos = u64::try_from(nanos).map_err(|_| format!("`{s}` is too long"))?;
        Ok(Dur(Duration::from_nanos(nanos)))
    }
}

/// `num` (digits with at most one '.') times `scale`, exactly, in integers.
fn scaled(num: &str, scale: u128) -> Option<u128> {
    let (int, frac) = match num.split_once('.') {
        Some((i, f)) => (i, f),
        None => (num, ""),
    };
    if int.is_empty() && frac.is_empty() {
        return None;
    }
    let all_digits = |p: &str| p.bytes().all(|b| b.is_ascii_digit());
    if !all_digits(int) || !all_digits(frac) || frac.len() > 9 {
        return None;
    }
    let int: u128 = if int.is_empty() { 0 } else { int.parse().ok()? };
    let mut value = int.checked_mul(scale)?;
    if !frac.is_empty() {
        let digits: u128 = frac.parse().ok()?;
        let denom = 10u128.pow(frac.len() as u32);
        value = value.checked_add(digits.checked_mul(scale)? / denom)?;
    }
    Some(value)
}

impl Rate {
    pub fn parse(s: &str) -> Result<Rate, String> {
        let s = s.trim();
        let (q, p) = s.split_once('/').ok_or_else(|| format!("`{s}` has no `/`; expected {RATE_EXPECTED}"))?;
        let quantity: u64 =
            q.trim().parse().map_err(|_| format!("`{q}` is not a whole number in `{s}`; expected {RATE_EXPECTED}"))?;
        if quantity == 0 {
            return Err(format!("`{s}` admits nothing; the quantity must be at least 1"));
        }
        let p = p.trim();
        let period = match p {
            "s" | "sec" | "second" => Duration::from_secs(1),
            "m" | "min" | "minute" => Duration::from_secs(60),
            "h" | "hour" => Duration::from_secs(3_600),
            "d" | "day" => Duration::from_secs(86_400),
            "month" => MONTH,
            other => Dur::parse(other).map_err(|e| format!("bad period in `{s}`: {e}"))?.0,
        };
        if period.is_zero() {
            return Err(format!("`{s}` has a zero period"));
        }
        Ok(Rate { quantity, period, month: p == "month" })
    }

    /// Period in whole microseconds.
    pub fn period_micros(&self) -> u64 {
        u64::try_from(self.period.as_micros()).unwrap_or(u64::MAX)
    }
}

/// The duration as a person reads it, and as the config writes it (it parses back to the
/// same number of µs): whole hours or minutes, else seconds or, under a second, milliseconds
/// with up to three decimals (`1.5s`, `333.333ms`), else microseconds.
impl fmt::Display for Dur {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        /// `us` in units of `per` µs, with the decimals it needs (at most three).
        fn decimal(f: &mut fmt::Formatter<'_>, us: u128, per: u128, unit: &str) -> fmt::Result {
            let (whole, rest) = (us / per, us % per);
            if rest == 0 {
                return write!(f, "{whole}{unit}");
            }
            // per is 1000 or 10^6: three decimals are exact when rest is a multiple of per/1000.
            let thousandths = rest / (per / 1000);
            let digits = format!("{thousandths:03}");
            write!(f, "{whole}.{}{unit}", digits.trim_end_matches('0'))
        }
        let us = self.0.as_micros();
        match us {
            0 => write!(f, "0s"),
            us if us % 3_600_000_000 == 0 => write!(f, "{}h", us / 3_600_000_000),
            us if us % 60_000_000 == 0 => write!(f, "{}m", us / 60_000_000),
            us if us >= 1_000_000 && us % 1_000 == 0 => decimal(f, us, 1_000_000, "s"),
            us if us >= 1_000 => decimal(f, us, 1_000, "ms"),
            us => write!(f, "{us}us"),
        }
    }
}

impl fmt::Display for Rate {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.month {
            return write!(f, "{}/month", self.quantity);
        }
        match self.period.as_secs() {
            1 if self.period.subsec_nanos() == 0 => write!(f, "{}/s", self.quantity),
            60 if self.period.subsec_nanos() == 0 => write!(f, "{}/m", self.quantity),
            3_600 if self.period.subsec_nanos() == 0 => write!(f, "{}/h", self.quantity),
            _ => write!(f, "{}/{}", self.quantity, Dur(self.period)),
        }
    }
}

struct StrVisitor(&'static str);

impl Visitor<'_> for StrVisitor {
    type Value = String;
    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.0)
    }
    fn visit_str<E: de::Error>(self, v: &str) -> Result<String, E> {
        Ok(v.to_owned())
    }
    fn visit_u64<E: de::Error>(self, v: u64) -> Result<String, E> {
        Ok(v.to_string())
    }
}

impl<'de> Deserialize<'de> for Dur {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let s = d.deserialize_any(StrVisitor(DURATION_EXPECTED))?;
        Dur::parse(&s).map_err(de::Error::custom)
    }
}

impl<'de> Deserialize<'de> for Rate {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let s = d.deserialize_any(StrVisitor(RATE_EXPECTED))?;
        Rate::parse(&s).map_err(de::Error::custom)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_durations() {
        assert_eq!(Dur::parse("250ms").unwrap().0, Duration::from_millis(250));
        assert_eq!(Dur::parse("2s").unwrap().0, Duration::from_secs(2));
        assert_eq!(Dur::parse("5m").unwrap().0, Duration::from_secs(300));
        assert_eq!(Dur::parse("1.5s").unwrap().0, Duration::from_millis(1500));
        assert_eq!(Dur::parse("0").unwrap().0, Duration::ZERO);
        assert_eq!(Dur::parse("20us").unwrap().0, Duration::from_micros(20));
    }

    #[test]
    fn durations_print_in_human_units_that_parse_back() {
        for (us, text) in [
            (0, "0s"),
            (7, "7us"),
            (1_000, "1ms"),
            (1_500, "1.5ms"),
            (333_333, "333.333ms"),
            (1_000_000, "1s"),
            (1_500_000, "1.5s"),
            (1_234_567, "1234.567ms"),
            (2_050_000, "2.05s"),
            (90_000_000, "90s"),
            (300_000_000, "5m"),
            (7_200_000_000, "2h"),
        ] {
            let d = Dur(Duration::from_micros(us));
            assert_eq!(d.to_string(), text);
            assert_eq!(Dur::parse(text).unwrap(), d, "{text} parses back");
        }
    }

    #[test]
    fn rejects_bad_durations() {
        for bad in ["", "5", "ms", "5 parsecs", "1..2s", "-1s", "1e3ms"] {
            assert!(Dur::parse(bad).is_err(), "{bad} should fail");
        }
    }

    #[test]
    fn parses_sizes() {
        assert_eq!(Size::parse("65536").unwrap().0, 65536);
        assert_eq!(Size::parse("64MiB").unwrap().0, 64 << 20);
        assert_eq!(Size::parse("512kb").unwrap().0, 512 << 10);
        assert!(Size::parse("12 parsecs").is_err());
        assert!(Size::parse("MiB").is_err());
    }

    #[test]
    fn parses_rates() {
        let r = Rate::parse("100/s").unwrap();
        assert_eq!((r.quantity, r.period), (100, Duration::from_secs(1)));
        let r = Rate::parse("1000/60s").unwrap();
        assert_eq!((r.quantity, r.period), (1000, Duration::from_secs(60)));
        assert_eq!(Rate::parse("5/m").unwrap().period, Duration::from_secs(60));
        assert_eq!(Rate::parse("5/h").unwrap().to_string(), "5/h");
        assert_eq!(Rate::parse("10/90s").unwrap().to_string(), "10/90s");
    }

    #[test]
    fn rejects_bad_rates() {
        for bad in ["100", "0/s", "x/s", "10/0s", "10/fortnight", "-1/s"] {
            assert!(Rate::parse(bad).is_err(), "{bad} should fail");
        }
    }
}
