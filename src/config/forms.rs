//! Fields written in one of several forms: a word or a number, a mapping or a list (`auth: none`
//! or `auth: { api_key: … }`, `concurrency: 8` or `concurrency: { max: 8 }`, a certificate's
//! name or its list of names).
//!
//! serde's untagged enums try each form and, when none fits, say only "data did not match
//! any variant", at the field that holds the mapping: a missing or misspelt field inside it
//! is lost. Here the form is chosen by what the YAML holds, and a mapping is read by its own
//! struct, so its errors keep their field, their path and their line; a value of no allowed
//! form is "invalid type: …, expected" the forms in words.

use std::fmt;
use std::marker::PhantomData;

use serde::de::value::{MapAccessDeserializer, SeqAccessDeserializer};
use serde::de::{self, Deserialize, Deserializer, MapAccess, SeqAccess, Unexpected, Visitor};

/// A type written in one of several forms. Each reader returns `None` for a form the type
/// does not take.
pub(super) trait Forms: Sized {
    /// The forms in words, after "expected".
    const EXPECTING: &'static str;

    fn text(s: &str) -> Option<Self> {
        let _ = s;
        None
    }

    fn number(n: u64) -> Option<Self> {
        let _ = n;
        None
    }

    fn flag(b: bool) -> Option<Self> {
        let _ = b;
        None
    }

    fn map<'de, M: MapAccess<'de>>(map: M) -> Option<Result<Self, M::Error>> {
        let _ = map;
        None
    }

    fn seq<'de, A: SeqAccess<'de>>(seq: A) -> Option<Result<Self, A::Error>> {
        let _ = seq;
        None
    }
}

/// Reads a mapping as `T` (a struct that denies unknown fields), for [`Forms::map`].
pub(super) fn read_map<'de, T: Deserialize<'de>, M: MapAccess<'de>>(map: M) -> Result<T, M::Error> {
    T::deserialize(MapAccessDeserializer::new(map))
}

/// Reads a sequence as `T`, for [`Forms::seq`].
pub(super) fn read_seq<'de, T: Deserialize<'de>, A: SeqAccess<'de>>(seq: A) -> Result<T, A::Error> {
    T::deserialize(SeqAccessDeserializer::new(seq))
}

/// Deserializes a [`Forms`] type by the form the value has.
pub(super) fn deserialize<'de, D: Deserializer<'de>, T: Forms>(d: D) -> Result<T, D::Error> {
    d.deserialize_any(FormVisitor(PhantomData))
}

struct FormVisitor<T>(PhantomData<T>);

impl<'de, T: Forms> Visitor<'de> for FormVisitor<T> {
    type Value = T;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(T::EXPECTING)
    }

    fn visit_str<E: de::Error>(self, v: &str) -> Result<T, E> {
        T::text(v).ok_or_else(|| E::invalid_value(Unexpected::Str(v), &self))
    }

    fn visit_u64<E: de::Error>(self, v: u64) -> Result<T, E> {
        T::number(v).ok_or_else(|| E::invalid_value(Unexpected::Unsigned(v), &self))
    }

    fn visit_bool<E: de::Error>(self, v: bool) -> Result<T, E> {
        T::flag(v).ok_or_else(|| E::invalid_type(Unexpected::Bool(v), &self))
    }

    fn visit_i64<E: de::Error>(self, v: i64) -> Result<T, E> {
        match u64::try_from(v) {
            Ok(n) => self.visit_u64(n),
            Err(_) => Err(E::invalid_value(Unexpected::Signed(v), &self)),
        }
    }

    fn visit_map<M: MapAccess<'de>>(self, map: M) -> Result<T, M::Error> {
        T::map(map).unwrap_or_else(|| Err(de::Error::invalid_type(Unexpected::Map, &self)))
    }

    fn visit_seq<A: SeqAccess<'de>>(self, seq: A) -> Result<T, A::Error> {
        T::seq(seq).unwrap_or_else(|| Err(de::Error::invalid_type(Unexpected::Seq, &self)))
    }
}

/// `impl Deserialize` for a [`Forms`] type.
macro_rules! by_form {
    ($t:ty) => {
        impl<'de> serde::Deserialize<'de> for $t {
            fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
                crate::config::forms::deserialize(d)
            }
        }
    };
}
pub(super) use by_form;
