//! The built-in responder as a load-test target: its answers drawn from the faults of its
//! config ([`crate::config::respond::Faults`]): a latency distribution, error answers,
//! answers cut mid-body, a body of a given size, a slow body.
//!
//! The draws come from one random source per worker thread (seeded from `seed`, or at random),
//! each behind a mutex only its own worker takes: no lock is shared between workers. A run
//! with `server.workers: 1` and a `seed` draws the same sequence every time.

use std::future::Future;
use std::pin::Pin;
use std::sync::{Mutex, PoisonError};
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::Bytes;
use http::{HeaderValue, Response};
use http_body::{Frame, SizeHint};

use crate::body::{Body, BodyError};
use crate::config::respond::{Faults, Latency, Z99};
use crate::config::Responder;

/// The block a `body_size` body repeats (printable, so a client that shows it shows text).
const BLOCK: usize = 16 * 1024;

/// The longest latency drawn (a distribution's far tail is cut here).
const MAX_LATENCY: Duration = Duration::from_secs(3600);

/// A responder's faults, ready to draw.
pub struct Live {
    faults: Faults,
    rngs: Box<[Mutex<fastrand::Rng>]>,
    block: Bytes,
}

/// What one answer does.
#[derive(Debug, Clone, Copy, PartialEq)]
struct Draw {
    error: bool,
    cut: bool,
    latency: Duration,
}

impl Live {
    /// One random source per worker of `workers`.
    pub fn new(faults: &Faults, workers: usize) -> Live {
        let seed = faults.seed.unwrap_or_else(|| fastrand::u64(..));
        let rngs = (0..workers.max(1) as u64)
            .map(|i| Mutex::new(fastrand::Rng::with_seed(seed.wrapping_add(i.wrapping_mul(0x9E37_79B9_7F4A_7C15)))))
            .collect();
        let block = if faults.body_size.is_some() {
            Bytes::from(
                (0..BLOCK).map(|i| if i % 64 == 63 { b'\n' } else { b'a' + (i % 26) as u8 }).collect::<Vec<u8>>(),
            )
        } else {
            Bytes::new()
        };
        Live { faults: faults.clone(), rngs, block }
    }

    fn draw(&self, fixed: Duration) -> Draw {
        let rng = &self.rngs[crate::workers::index() % self.rngs.len()];
        let mut rng = rng.lock().unwrap_or_else(PoisonError::into_inner);
        draw(&self.faults, fixed, &mut rng)
    }

    /// The answer of `r`, after its latency.
    pub async fn respond(&self, r: &Responder) -> Response<Body> {
        let d = self.draw(r.latency);
        if !d.latency.is_zero() {
            tokio::time::sleep(d.latency).await;
        }
        if let (true, Some(e)) = (d.error, self.faults.errors) {
            let mut resp = Response::new(Body::full("an error the responder was told to give (respond.errors)\n"));
            *resp.status_mut() = e.status;
            resp.headers_mut()
                .insert(http::header::CONTENT_TYPE, HeaderValue::from_static("text/plain; charset=utf-8"));
            return resp;
        }
        let (source, total) = match self.faults.body_size {
            Some(n) => (self.block.clone(), n),
            None => (r.body.clone(), r.body.len() as u64),
        };
        let drip = self.faults.drip;
        let body = if drip.is_none() && !d.cut && total <= source.len() as u64 {
            Body::full(source.slice(..total as usize))
        } else {
            Body::boxed(Made {
                source,
                total,
                sent: 0,
                piece: drip.map_or(BLOCK as u64, |d| d.bytes),
                every: drip.map(|d| d.every),
                wait: None,
                cut_at: d.cut.then_some(total / 2),
            })
        };
        let mut resp = Response::new(body);
        *resp.status_mut() = r.status;
        resp.headers_mut().clone_from(&r.headers);
        resp
    }
}

/// One answer's draws, in a fixed order (so a seed repeats them).
fn draw(f: &Faults, fixed: Duration, rng: &mut fastrand::Rng) -> Draw {
    let error = f.errors.is_some_and(|e| rng.f64() < e.share);
    let cut = f.resets > 0.0 && rng.f64() < f.resets;
    let latency = f.latency.map_or(fixed, |l| sample(l, rng));
    Draw { error, cut: cut && !error, latency }
}

/// A standard normal draw (Box–Muller).
fn normal(rng: &mut fastrand::Rng) -> f64 {
    let u1 = 1.0 - rng.f64(); // (0, 1]: its logarithm is finite
    let u2 = rng.f64();
    (-2.0 * u1.ln()).sqrt() * (std::f64::consts::TAU * u2).cos()
}

fn sample(l: Latency, rng: &mut fastrand::Rng) -> Duration {
    let secs = match l {
        Latency::Uniform { min, max } => min.as_secs_f64() + (max - min).as_secs_f64() * rng.f64(),
        Latency::Normal { p50, p99 } => {
            let sd = (p99 - p50).as_secs_f64() / Z99;
            p50.as_secs_f64() + sd * normal(rng)
        }
        Latency::LogNormal { p50, p99 } => {
            let sigma = (p99.as_secs_f64() / p50.as_secs_f64()).ln() / Z99;
            (p50.as_secs_f64().ln() + sigma * normal(rng)).exp()
        }
    };
    Duration::try_from_secs_f64(secs.max(0.0)).unwrap_or(MAX_LATENCY).min(MAX_LATENCY)
}

/// A body made of `source` repeated up to `total` bytes, in pieces of `piece`, one every
/// `every`; cut (an error, so the client's connection or stream is reset) after `cut_at`.
struct Made {
    source: Bytes,
    total: u64,
    sent: u64,
    piece: u64,
    every: Option<Duration>,
    wait: Option<Pin<Box<tokio::time::Sleep>>>,
    cut_at: Option<u64>,
}

impl http_body::Body for Made {
    type Data = Bytes;
    type Error = BodyError;

    fn poll_frame(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Result<Frame<Bytes>, BodyError>>> {
        let this = &mut *self;
        if let Some(wait) = this.wait.as_mut() {
            if wait.as_mut().poll(cx).is_pending() {
                return Poll::Pending;
            }
            this.wait = None;
        }
        let end = this.cut_at.unwrap_or(this.total);
        if this.sent >= end {
            return Poll::Ready(this.cut_at.map(|_| Err(BodyError::Cut)));
        }
        if this.source.is_empty() {
            return Poll::Ready(Some(Err(BodyError::Cut)));
        }
        let at = (this.sent % this.source.len() as u64) as usize;
        let n = (end - this.sent).min(this.piece).min((this.source.len() - at) as u64) as usize;
        this.sent += n as u64;
        if let Some(every) = this.every {
            if this.sent < end {
                this.wait = Some(Box::pin(tokio::time::sleep(every)));
            }
        }
        Poll::Ready(Some(Ok(Frame::data(this.source.slice(at..at + n)))))
    }

    fn is_end_stream(&self) -> bool {
        self.cut_at.is_none() && self.sent >= self.total
    }

    fn size_hint(&self) -> SizeHint {
        // A cut body still promises its whole length: the client sees it end short.
        if self.total == 0 {
            return SizeHint::default();
        }
        SizeHint::with_exact(self.total - self.sent.min(self.total))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::respond::{Drip, ErrorShare};

    fn faults(latency: Option<Latency>) -> Faults {
        Faults { latency, errors: None, resets: 0.0, body_size: None, drip: None, seed: Some(7) }
    }

    /// The `q` quantile of `n` draws, in milliseconds.
    fn quantiles(l: Latency, n: usize) -> (f64, f64) {
        let mut rng = fastrand::Rng::with_seed(1);
        let mut v: Vec<f64> = (0..n).map(|_| sample(l, &mut rng).as_secs_f64() * 1000.0).collect();
        v.sort_by(f64::total_cmp);
        (v[n / 2], v[n * 99 / 100])
    }

    #[test]
    fn each_distribution_has_the_p50_and_p99_it_was_given() {
        let ms = Duration::from_millis;
        let near = |got: f64, want: f64| (got - want).abs() <= want * 0.05;
        for l in [Latency::LogNormal { p50: ms(20), p99: ms(200) }, Latency::Normal { p50: ms(50), p99: ms(80) }] {
            let (p50, p99) = quantiles(l, 100_000);
            let (Latency::LogNormal { p50: w50, p99: w99 } | Latency::Normal { p50: w50, p99: w99 }) = l else {
                unreachable!()
            };
            let (w50, w99) = (w50.as_secs_f64() * 1000.0, w99.as_secs_f64() * 1000.0);
            assert!(near(p50, w50) && near(p99, w99), "{l:?}: p50 {p50:.2} ms, p99 {p99:.2} ms");
        }
        let (p50, p99) = quantiles(Latency::Uniform { min: ms(10), max: ms(30) }, 100_000);
        assert!(near(p50, 20.0) && near(p99, 29.8), "uniform: p50 {p50:.2}, p99 {p99:.2}");
        // A normal draw below zero waits nothing; none is negative.
        let (p50, _) = quantiles(Latency::Normal { p50: ms(0), p99: ms(10) }, 1_000);
        assert!(p50 >= 0.0);
    }

    #[test]
    fn a_seed_repeats_the_draws_and_each_worker_has_its_own() {
        let f = Faults {
            errors: Some(ErrorShare { share: 0.3, status: http::StatusCode::SERVICE_UNAVAILABLE }),
            resets: 0.2,
            ..faults(Some(Latency::LogNormal { p50: Duration::from_millis(5), p99: Duration::from_millis(50) }))
        };
        let run = |live: &Live| (0..200).map(|_| live.draw(Duration::ZERO)).collect::<Vec<_>>();
        let (a, b) = (Live::new(&f, 2), Live::new(&f, 2));
        assert_eq!(run(&a), run(&b));
        let other = Live::new(&Faults { seed: Some(8), ..f.clone() }, 2);
        assert_ne!(run(&a), run(&other));
        // Worker 1 draws from its own source: not worker 0's sequence.
        let mut w0 = a.rngs[0].lock().unwrap().clone();
        let mut w1 = a.rngs[1].lock().unwrap().clone();
        assert_ne!(draw(&f, Duration::ZERO, &mut w0), draw(&f, Duration::ZERO, &mut w1));
        // The shares hold over many draws; an error is never also cut.
        let draws: Vec<Draw> = (0..20_000).map(|_| a.draw(Duration::ZERO)).collect();
        let share = |p: fn(&Draw) -> bool| draws.iter().filter(|d| p(d)).count() as f64 / draws.len() as f64;
        assert!((share(|d| d.error) - 0.3).abs() < 0.02, "{}", share(|d| d.error));
        assert!((share(|d| d.cut) - 0.7 * 0.2).abs() < 0.02, "{}", share(|d| d.cut));
        assert!(!draws.iter().any(|d| d.error && d.cut));
    }

    #[tokio::test]
    async fn a_slow_body_sends_its_pieces_with_a_pause_between() {
        use http_body_util::BodyExt;
        let every = Duration::from_millis(30);
        let f = Faults { body_size: Some(10_000), drip: Some(Drip { bytes: 4_000, every }), ..faults(None) };
        let live = Live::new(&f, 1);
        let r = Responder {
            status: http::StatusCode::OK,
            headers: http::HeaderMap::new(),
            body: Bytes::new(),
            latency: Duration::ZERO,
            max_body: 0,
            faults: None,
        };
        let mut body = live.respond(&r).await.into_body();
        assert_eq!(http_body::Body::size_hint(&body).exact(), Some(10_000));
        let mut pieces = Vec::new();
        let start = std::time::Instant::now();
        while let Some(frame) = body.frame().await {
            pieces.push(frame.unwrap().into_data().unwrap().len());
        }
        assert_eq!(pieces, [4_000, 4_000, 2_000]);
        // Two pauses at least (a loaded machine only adds to it).
        assert!(start.elapsed() >= every * 2);
    }

    #[tokio::test]
    async fn a_cut_body_ends_in_an_error_after_half_of_it() {
        use http_body_util::BodyExt;
        let f = Faults { resets: 1.0, body_size: Some(40_000), ..faults(None) };
        let live = Live::new(&f, 1);
        let r = Responder {
            status: http::StatusCode::OK,
            headers: http::HeaderMap::new(),
            body: Bytes::new(),
            latency: Duration::ZERO,
            max_body: 0,
            faults: None,
        };
        let mut body = live.respond(&r).await.into_body();
        let mut got = 0;
        loop {
            match body.frame().await {
                Some(Ok(f)) => got += f.into_data().unwrap().len(),
                Some(Err(e)) => {
                    assert!(matches!(e, BodyError::Cut));
                    break;
                }
                None => panic!("the body ended without its cut"),
            }
        }
        assert_eq!(got, 20_000);
    }
}
