//! One answer's encoder, over each crate's raw streaming interface: input in, output appended
//! to a `Vec`, and three moves: encode (the encoder keeps what it has not emitted), flush
//! (everything given so far can be decoded by the client now), finish (the end of the stream).

use std::io;

use brotli::enc::encode::{BrotliEncoderOperation, BrotliEncoderParameter, BrotliEncoderStateStruct};
use brotli::enc::interface::{InputPair, InputReferenceMut, PredictionModeContextMap, StaticCommand};
use brotli::enc::StandardAlloc;
use flate2::{Compress, Compression, FlushCompress, Status};
use zstd::stream::raw::{InBuffer, Operation, OutBuffer};

use crate::config::compression::Coding;

/// Room made in the output before each call of an encoder.
const ROOM: usize = 8 << 10;

pub enum Encoder {
    Gzip(Box<Compress>),
    Br(Box<BrotliEncoderStateStruct<StandardAlloc>>),
    Zstd(Box<zstd::stream::raw::Encoder<'static>>),
}

/// The bits of a window that holds `len` bytes: an answer of known, small length gets an
/// encoder of its size, not one of the coding's largest window.
fn window_bits(len: Option<u64>, min: u32, max: u32) -> u32 {
    let Some(len) = len else { return max };
    let bits = 64 - len.saturating_sub(1).leading_zeros();
    bits.clamp(min, max)
}

impl Encoder {
    /// An encoder for `coding` at `level` (validated by the config); `size`: the answer's
    /// exact length when its body knows it (zstd fails a stream of another length).
    pub fn new(coding: Coding, level: i32, size: Option<u64>) -> io::Result<Encoder> {
        Ok(match coding {
            Coding::Gzip => {
                let level = Compression::new(level.clamp(1, 9) as u32);
                // zlib's smallest window for deflate is 2^9.
                let bits = window_bits(size, 9, 15) as u8;
                Encoder::Gzip(Box::new(Compress::new_gzip(level, bits)))
            }
            Coding::Br => {
                let mut s = BrotliEncoderStateStruct::new(StandardAlloc::default());
                s.set_parameter(BrotliEncoderParameter::BROTLI_PARAM_QUALITY, level.clamp(0, 11) as u32);
                // 22 (4 MiB) is brotli's own default; an answer of known size gets its own.
                s.set_parameter(BrotliEncoderParameter::BROTLI_PARAM_LGWIN, window_bits(size, 10, 22));
                if let Some(size) = size {
                    s.set_parameter(BrotliEncoderParameter::BROTLI_PARAM_SIZE_HINT, size.min(1 << 30) as u32);
                }
                Encoder::Br(Box::new(s))
            }
            Coding::Zstd => {
                let mut e = zstd::stream::raw::Encoder::new(level)?;
                // zstd sizes its window and tables for the length (a 2 KiB answer does not get
                // level 3's megabyte of them); the length must be exact, as the body's own is.
                e.set_pledged_src_size(size)?;
                Encoder::Zstd(Box::new(e))
            }
        })
    }

    /// Encodes `input`, appending what the encoder emits to `out` (it may keep some back).
    pub fn encode(&mut self, input: &[u8], out: &mut Vec<u8>) -> io::Result<()> {
        match self {
            Encoder::Gzip(c) => {
                let mut rest = input;
                while !rest.is_empty() {
                    out.reserve(ROOM.max(rest.len() / 2));
                    let before = c.total_in();
                    c.compress_vec(rest, out, FlushCompress::None).map_err(io::Error::other)?;
                    rest = &rest[(c.total_in() - before) as usize..];
                }
                Ok(())
            }
            Encoder::Br(s) => brotli_run(s, BrotliEncoderOperation::BROTLI_OPERATION_PROCESS, input, out),
            Encoder::Zstd(e) => {
                let mut inb = InBuffer::around(input);
                while inb.pos() < input.len() {
                    out.reserve(ROOM.max((input.len() - inb.pos()) / 2));
                    let pos = out.len();
                    let mut outb = OutBuffer::around_pos(out, pos);
                    e.run(&mut inb, &mut outb)?;
                }
                Ok(())
            }
        }
    }

    /// Emits everything given so far in a form the client can decode at once (zlib's sync
    /// flush, brotli's and zstd's flush); the stream goes on.
    pub fn flush(&mut self, out: &mut Vec<u8>) -> io::Result<()> {
        match self {
            Encoder::Gzip(c) => loop {
                out.reserve(ROOM);
                c.compress_vec(&[], out, FlushCompress::Sync).map_err(io::Error::other)?;
                // A flush that stopped with room left is complete.
                if out.len() < out.capacity() {
                    return Ok(());
                }
            },
            Encoder::Br(s) => brotli_run(s, BrotliEncoderOperation::BROTLI_OPERATION_FLUSH, &[], out),
            Encoder::Zstd(e) => loop {
                out.reserve(ROOM);
                let pos = out.len();
                if e.flush(&mut OutBuffer::around_pos(out, pos))? == 0 {
                    return Ok(());
                }
            },
        }
    }

    /// Ends the stream (gzip's trailer, brotli's last block, zstd's frame end).
    pub fn finish(&mut self, out: &mut Vec<u8>) -> io::Result<()> {
        match self {
            Encoder::Gzip(c) => loop {
                out.reserve(ROOM);
                if c.compress_vec(&[], out, FlushCompress::Finish).map_err(io::Error::other)? == Status::StreamEnd {
                    return Ok(());
                }
            },
            Encoder::Br(s) => brotli_run(s, BrotliEncoderOperation::BROTLI_OPERATION_FINISH, &[], out),
            Encoder::Zstd(e) => loop {
                out.reserve(ROOM);
                let pos = out.len();
                if e.finish(&mut OutBuffer::around_pos(out, pos), true)? == 0 {
                    return Ok(());
                }
            },
        }
    }
}

/// Brotli's callback for each block it makes: nothing to do.
fn nop(
    _: &mut PredictionModeContextMap<InputReferenceMut>,
    _: &mut [StaticCommand],
    _: InputPair,
    _: &mut StandardAlloc,
) {
}

/// Runs brotli's stream step with `op` until its input is taken and, for a flush or the
/// finish, until it has nothing left to emit.
fn brotli_run(
    s: &mut BrotliEncoderStateStruct<StandardAlloc>,
    op: BrotliEncoderOperation,
    input: &[u8],
    out: &mut Vec<u8>,
) -> io::Result<()> {
    let (mut avail_in, mut in_at) = (input.len(), 0);
    loop {
        let start = out.len();
        let room = ROOM.max(avail_in / 2);
        out.resize(start + room, 0);
        let (mut avail_out, mut out_at, mut total) = (room, 0, None);
        let ok = s.compress_stream(
            op,
            &mut avail_in,
            input,
            &mut in_at,
            &mut avail_out,
            &mut out[start..],
            &mut out_at,
            &mut total,
            &mut nop,
        );
        out.truncate(start + out_at);
        if !ok {
            return Err(io::Error::other("brotli refused its input"));
        }
        let more = match op {
            BrotliEncoderOperation::BROTLI_OPERATION_FINISH => !s.is_finished(),
            BrotliEncoderOperation::BROTLI_OPERATION_FLUSH => s.has_more_output(),
            _ => false,
        };
        if avail_in == 0 && !more && avail_out > 0 {
            return Ok(());
        }
    }
}

#[cfg(test)]
mod tests {
    use std::io::Read;

    use super::*;

    fn decode(coding: Coding, data: &[u8]) -> Vec<u8> {
        let mut out = Vec::new();
        match coding {
            Coding::Gzip => {
                flate2::read::GzDecoder::new(data).read_to_end(&mut out).unwrap();
            }
            Coding::Br => {
                brotli::Decompressor::new(data, 4096).read_to_end(&mut out).unwrap();
            }
            Coding::Zstd => {
                zstd::stream::read::Decoder::new(data).unwrap().read_to_end(&mut out).unwrap();
            }
        }
        out
    }

    fn text(n: usize) -> Vec<u8> {
        (0..n).map(|i| b"{\"id\":12,\"name\":\"tollgate\"},\n"[i % 28]).collect()
    }

    #[test]
    fn every_coding_round_trips_in_chunks_with_flushes() {
        let data = text(300_000);
        for coding in [Coding::Gzip, Coding::Br, Coding::Zstd] {
            for size in [None, Some(data.len() as u64)] {
                let mut e = Encoder::new(coding, 4, size).unwrap();
                let mut out = Vec::new();
                for (i, chunk) in data.chunks(7_000).enumerate() {
                    e.encode(chunk, &mut out).unwrap();
                    if i % 5 == 0 {
                        e.flush(&mut out).unwrap();
                    }
                }
                e.finish(&mut out).unwrap();
                assert!(out.len() < data.len() / 10, "{coding:?}: {} bytes", out.len());
                assert_eq!(decode(coding, &out), data, "{coding:?}");
            }
        }
    }

    #[test]
    fn a_flush_makes_everything_so_far_decodable() {
        for coding in [Coding::Gzip, Coding::Br, Coding::Zstd] {
            let mut e = Encoder::new(coding, 4, None).unwrap();
            let mut out = Vec::new();
            e.encode(b"data: one\n\n", &mut out).unwrap();
            e.flush(&mut out).unwrap();
            // A streaming decoder given only what was emitted yields the whole event.
            let mut got = vec![0u8; 64];
            let n = match coding {
                Coding::Gzip => flate2::read::GzDecoder::new(&out[..]).read(&mut got).unwrap(),
                Coding::Br => brotli::Decompressor::new(&out[..], 4096).read(&mut got).unwrap(),
                Coding::Zstd => zstd::stream::read::Decoder::new(&out[..]).unwrap().read(&mut got).unwrap(),
            };
            assert_eq!(&got[..n], b"data: one\n\n", "{coding:?}");
        }
    }

    #[test]
    fn an_empty_stream_is_a_valid_one() {
        for coding in [Coding::Gzip, Coding::Br, Coding::Zstd] {
            let mut e = Encoder::new(coding, 1, Some(0)).unwrap();
            let mut out = Vec::new();
            e.finish(&mut out).unwrap();
            assert!(decode(coding, &out).is_empty(), "{coding:?}");
        }
    }

    #[test]
    fn window_follows_a_known_size() {
        assert_eq!(window_bits(None, 10, 22), 22);
        assert_eq!(window_bits(Some(0), 10, 22), 10);
        assert_eq!(window_bits(Some(5000), 9, 15), 13);
        assert_eq!(window_bits(Some(1 << 13), 9, 15), 13);
        assert_eq!(window_bits(Some((1 << 13) + 1), 9, 15), 14);
        assert_eq!(window_bits(Some(1 << 40), 10, 22), 22);
    }
}
