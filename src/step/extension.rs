//! Steps of a program that embeds tollgate: a [`Step`] made by a factory registered under a
//! name ([`register`]), from the YAML value a route gives that name under `extensions:`. The
//! value is checked by the same factory when a config loads, so a bad one is refused with its
//! file, line and column; the step is made again at each build (a reload makes new ones).
//!
//! Only routes that list an extension pay for it: one virtual call per side and step.

use std::any::Any;
use std::sync::Arc;

use bytes::Bytes;
use http::request::Parts;
use http::{HeaderMap, Response, StatusCode};

use super::{Answered, Arrival, Arrived, Build, Builtin, Flow, Notes, Seen};
use crate::answer::Error;
use crate::body::Body;
use crate::config::{Config, Route};

/// A step's YAML value (`extensions: { NAME: VALUE }`).
pub use serde_yaml::Value;

/// A per-route step of a program that embeds tollgate.
pub trait Step: Send + Sync + 'static {
    /// The request side, after the route's built-in steps (credentials checked) and before
    /// its limits: change the head that goes upstream, or answer at once with `Some`.
    fn request(&self, head: &mut Parts) -> Option<Response<Bytes>> {
        let _ = head;
        None
    }

    /// The answer side, on every answer of the route: the upstream's, and tollgate's own
    /// (`429`, `401`, `503`, ...), as [`Answer::from`] tells.
    fn answer(&self, answer: &mut Answer<'_>) {
        let _ = answer;
    }

    /// What the step does, in one line, for `tollgate explain`.
    fn explain(&self) -> String;
}

/// An answer as a step's answer side sees it.
pub struct Answer<'a> {
    status: StatusCode,
    headers: &'a mut HeaderMap,
    from: Answered,
}

impl Answer<'_> {
    pub fn status(&self) -> StatusCode {
        self.status
    }

    pub fn headers(&self) -> &HeaderMap {
        self.headers
    }

    pub fn headers_mut(&mut self) -> &mut HeaderMap {
        self.headers
    }

    /// Where the answer came from (the upstream, or tollgate itself).
    pub fn from(&self) -> Answered {
        self.from
    }
}

/// Makes a step from its YAML value; the message of an error says what is wrong with it.
type Factory = dyn Fn(&Value) -> Result<Arc<dyn Step>, String> + Send + Sync;

/// Registers the step `name`: a route with `extensions: { NAME: VALUE }` gets the step that
/// `factory` makes of `VALUE`. The factory runs at each load (its error refuses the config,
/// positioned at the value) and at each build of the proxy.
///
/// # Errors
/// `name` is not a name (letters, digits, `-`, `_`, `.`), or a step has it already.
pub fn register<F>(name: &str, factory: F) -> Result<(), String>
where
    F: Fn(&Value) -> Result<Arc<dyn Step>, String> + Send + Sync + 'static,
{
    let factory: Arc<Factory> = Arc::new(factory);
    let check = factory.clone();
    let check: crate::config::extension::Check = Arc::new(move |v: &Value| check(v).map(drop));
    crate::config::extension::register(name, check, Arc::new(factory))
}

/// A route's extension steps, in file order.
pub(crate) struct Extensions(Box<[Made]>);

enum Made {
    Step(Arc<dyn Step>),
    /// A factory that took its value at load and refused it now: the route refuses every
    /// request (`500`) rather than serve without the step.
    Failed,
}

impl Builtin for Extensions {
    fn compile(b: &mut Build<'_>) -> Option<Extensions> {
        if b.route.extensions.is_empty() {
            return None;
        }
        let made = b.route.extensions.iter().map(|e| match make(&e.name, &e.value) {
            Ok(step) => Made::Step(step),
            Err(why) => {
                tracing::error!(route = b.route.name, step = e.name, "{why}; the route refuses every request");
                Made::Failed
            }
        });
        Some(Extensions(made.collect()))
    }

    fn describe(route: &Route, _: &Config) -> Option<String> {
        if route.extensions.is_empty() {
            return None;
        }
        let each: Vec<String> = route
            .extensions
            .iter()
            .map(|e| match make(&e.name, &e.value) {
                Ok(step) => format!("{}: {}", e.name, step.explain()),
                Err(why) => format!("{}: cannot be made ({why})", e.name),
            })
            .collect();
        Some(format!("extension steps: {}", each.join("; ")))
    }

    fn arrive<'a>(&'a self, a: &'a mut Arrival<'_>, _: &mut Seen) -> Arrived<'a> {
        for made in &self.0 {
            let Made::Step(step) = made else {
                return Arrived::Now(Flow::Refuse(Error::Internal("a step of this route could not be made")));
            };
            if let Some(answer) = step.request(a.parts) {
                return Arrived::Now(Flow::Answer(answer.map(Body::full)));
            }
        }
        Arrived::Now(Flow::Next)
    }

    fn answer(&self, _: &mut Seen, resp: &mut Response<Body>, from: Answered, _: &mut Notes<'_>) {
        let status = resp.status();
        let mut answer = Answer { status, headers: resp.headers_mut(), from };
        for made in self.0.iter().rev() {
            if let Made::Step(step) = made {
                step.answer(&mut answer);
            }
        }
    }
}

/// The step registered as `name`, made of `value`.
fn make(name: &str, value: &Value) -> Result<Arc<dyn Step>, String> {
    let any: Arc<dyn Any + Send + Sync> =
        crate::config::extension::factory(name).ok_or_else(|| format!("no step `{name}` is registered"))?;
    let factory = any.downcast::<Arc<Factory>>().map_err(|_| format!("step `{name}` was registered wrongly"))?;
    factory(value)
}
