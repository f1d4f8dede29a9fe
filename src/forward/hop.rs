//! `Max-Forwards` (RFC 9110 §7.6.2): how many more proxies an `OPTIONS` or `TRACE` may pass.
//! At `0` tollgate is the last hop and answers itself; above, the request goes on with one
//! less. Other methods ignore the field, as the RFC allows.

use http::header::{HeaderMap, HeaderValue, MAX_FORWARDS};

use crate::answer::Error;

const MALFORMED: &str = "`Max-Forwards` must be one decimal number";

/// Whether tollgate is the last hop of this `OPTIONS` or `TRACE`; when it is not, the field
/// is lowered by one for the next. A request without the field goes on as it is.
///
/// # Errors
/// A field that is not one decimal number (or appears twice): `400`.
pub fn last(headers: &mut HeaderMap) -> Result<bool, Error> {
    let mut fields = headers.get_all(MAX_FORWARDS).iter();
    let Some(value) = fields.next() else { return Ok(false) };
    if fields.next().is_some() {
        return Err(Error::BadRequest(MALFORMED));
    }
    let text = value.to_str().map_err(|_| Error::BadRequest(MALFORMED))?.trim();
    if text.is_empty() || !text.bytes().all(|b| b.is_ascii_digit()) {
        return Err(Error::BadRequest(MALFORMED));
    }
    // A value past u64 is as good as unbounded: it stays what it was.
    let Ok(n) = text.parse::<u64>() else { return Ok(false) };
    if n == 0 {
        return Ok(true);
    }
    headers.insert(MAX_FORWARDS, HeaderValue::from(n - 1));
    Ok(false)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn with(values: &[&str]) -> HeaderMap {
        let mut h = HeaderMap::new();
        for v in values {
            h.append(MAX_FORWARDS, HeaderValue::from_str(v).unwrap());
        }
        h
    }

    #[test]
    fn zero_is_the_last_hop_and_more_is_lowered_by_one() {
        let mut h = with(&["0"]);
        assert_eq!(last(&mut h), Ok(true));
        let mut h = with(&["5"]);
        assert_eq!(last(&mut h), Ok(false));
        assert_eq!(h.get(MAX_FORWARDS).unwrap(), "4");
        let mut h = with(&[" 1 "]);
        assert_eq!(last(&mut h), Ok(false));
        assert_eq!(h.get(MAX_FORWARDS).unwrap(), "0");
        let mut h = HeaderMap::new();
        assert_eq!(last(&mut h), Ok(false));
        assert!(h.get(MAX_FORWARDS).is_none());
        let mut h = with(&["99999999999999999999999"]);
        assert_eq!(last(&mut h), Ok(false));
    }

    #[test]
    fn a_malformed_or_repeated_field_is_a_bad_request() {
        for values in [&["-1"][..], &["a"], &[""], &["1, 2"], &["1", "2"], &["0x1"]] {
            assert_eq!(last(&mut with(values)), Err(Error::BadRequest(MALFORMED)), "{values:?}");
        }
    }
}
