//! `extensions:` on a route: steps that a program embedding tollgate registered by name
//! (`tollgate::step::register`), each with its YAML value. The names and their checks are
//! kept here, so a value the step refuses is refused when the config loads, with its file,
//! line, column and field like any other; the step itself is made by the `step` room at
//! `Proxy::build`, from the factory kept here unopened.

use std::any::Any;
use std::collections::BTreeMap;
use std::sync::{Arc, RwLock};

use super::{key, Invalid, Seg};

/// Checks a step's YAML value: the message says what is wrong with it.
pub type Check = Arc<dyn Fn(&serde_yaml::Value) -> Result<(), String> + Send + Sync>;

/// One registered step.
#[derive(Clone)]
struct Entry {
    check: Check,
    /// The `step` room's factory, which this room neither names nor calls.
    make: Arc<dyn Any + Send + Sync>,
}

/// Registered steps by name: written when a program starts, read when a config loads and when
/// a proxy is built (never on a request's path).
static REGISTERED: RwLock<BTreeMap<String, Entry>> = RwLock::new(BTreeMap::new());

/// The extension steps of one route, in the order the file lists them.
#[derive(Debug, Clone, PartialEq)]
pub struct Extension {
    pub name: String,
    pub value: serde_yaml::Value,
}

/// Registers step `name`: `check` is run on its value at each load, `make` is kept for the
/// `step` room.
///
/// # Errors
/// `name` is not a name (letters, digits, `-`, `_`, `.`) or is registered already.
pub fn register(name: &str, check: Check, make: Arc<dyn Any + Send + Sync>) -> Result<(), String> {
    super::limits::check_name(name)?;
    let mut all = REGISTERED.write().unwrap_or_else(std::sync::PoisonError::into_inner);
    if all.contains_key(name) {
        return Err(format!("a step named `{name}` is registered already"));
    }
    all.insert(name.to_owned(), Entry { check, make });
    Ok(())
}

/// The factory registered for `name`, for the `step` room to open.
pub fn factory(name: &str) -> Option<Arc<dyn Any + Send + Sync>> {
    let all = REGISTERED.read().unwrap_or_else(std::sync::PoisonError::into_inner);
    all.get(name).map(|e| e.make.clone())
}

/// A route's `extensions:` map, each value checked by its step.
pub(super) fn validate(raw: serde_yaml::Mapping, at: &[Seg]) -> Result<Vec<Extension>, Invalid> {
    let mut out = Vec::with_capacity(raw.len());
    for (k, value) in raw {
        let Some(name) = k.as_str().map(str::to_owned) else {
            return Err((at.to_vec(), "expected step names as keys (text)".to_owned()));
        };
        let mut path = at.to_vec();
        path.push(key(&name));
        let entry = {
            let all = REGISTERED.read().unwrap_or_else(std::sync::PoisonError::into_inner);
            match all.get(&name) {
                Some(e) => e.clone(),
                None => {
                    let known: Vec<&str> = all.keys().map(String::as_str).collect();
                    let known = if known.is_empty() {
                        "none is registered (a program that embeds tollgate registers its steps by name)".to_owned()
                    } else {
                        format!("registered: {}", known.join(", "))
                    };
                    return Err((path, format!("unknown step `{name}`; {known}")));
                }
            }
        };
        (entry.check)(&value).map_err(|e| (path, format!("step `{name}`: {e}")))?;
        out.push(Extension { name, value });
    }
    Ok(out)
}
