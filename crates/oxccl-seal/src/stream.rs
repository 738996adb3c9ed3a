//! Blocking streams carried in records: [`SealedStream`] and its halves.
//!
//! A half keeps its place across errors: a read that times out in the middle of a record (a
//! socket with a read timeout) is taken up where it stopped by the next read. A record that
//! fails to open poisons the reader: every later read fails with the same error, since nothing
//! after a forged or missing record can be trusted.

use std::io::{self, Read, Write};

use crate::{HEADER_LEN, MAX_RECORD, Opener, Sealer, Session, TAG_LEN};

/// What a reader has of the record it is reading, and the plaintext not yet handed out.
struct RecvState {
    opener: Opener,
    /// The header and body read so far.
    buf: Vec<u8>,
    /// Bytes of `buf` filled.
    filled: usize,
    /// Plaintext of the last record opened (in `buf[HEADER_LEN..]`) not yet read: its range.
    plain: std::ops::Range<usize>,
    /// The error that ended the stream, repeated to every later read.
    failed: Option<(io::ErrorKind, String)>,
    peer: String,
}

impl RecvState {
    fn new(opener: Opener, peer: String) -> RecvState {
        RecvState {
            opener,
            buf: vec![0; HEADER_LEN],
            filled: 0,
            plain: 0..0,
            failed: None,
            peer,
        }
    }

    fn fail(&mut self, e: crate::SealError) -> io::Error {
        let msg = format!("sealed stream from {}: {e}", self.peer);
        self.failed = Some((io::ErrorKind::InvalidData, msg.clone()));
        io::Error::new(io::ErrorKind::InvalidData, msg)
    }

    /// Reads until one record is open (or an error, kept for later reads if it is the stream's
    /// end). `Ok(false)`: the peer closed the stream between records.
    fn next_record(&mut self, inner: &mut impl Read) -> io::Result<bool> {
        loop {
            let want = if self.filled < HEADER_LEN {
                HEADER_LEN
            } else {
                // Infallible: `buf` starts HEADER_LEN bytes long and only grows, and
                // `[..HEADER_LEN]` is HEADER_LEN bytes.
                let header: [u8; HEADER_LEN] = self.buf[..HEADER_LEN].try_into().expect("12");
                match self.opener.check_header(&header) {
                    Ok(body) => HEADER_LEN + body,
                    Err(e) => return Err(self.fail(e)),
                }
            };
            if self.filled == want && want > HEADER_LEN {
                let (header, body) = self.buf.split_at_mut(HEADER_LEN);
                // Infallible: `split_at_mut(HEADER_LEN)` gave HEADER_LEN bytes.
                let header: [u8; HEADER_LEN] = (&*header).try_into().expect("12");
                let n = match self
                    .opener
                    .open_record(&header, &mut body[..want - HEADER_LEN])
                {
                    Ok(text) => text.len(),
                    Err(e) => return Err(self.fail(e)),
                };
                self.filled = 0;
                self.plain = HEADER_LEN..HEADER_LEN + n;
                return Ok(true);
            }
            if self.buf.len() < want {
                self.buf.resize(want, 0);
            }
            match inner.read(&mut self.buf[self.filled..want]) {
                Ok(0) if self.filled == 0 => return Ok(false),
                Ok(0) => {
                    let msg = format!(
                        "sealed stream from {}: the connection closed inside record {} ({} of \
                         {want} bytes)",
                        self.peer,
                        self.opener.records_opened(),
                        self.filled
                    );
                    self.failed = Some((io::ErrorKind::UnexpectedEof, msg.clone()));
                    return Err(io::Error::new(io::ErrorKind::UnexpectedEof, msg));
                }
                Ok(n) => self.filled += n,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) => return Err(e),
            }
        }
    }

    fn read(&mut self, inner: &mut impl Read, out: &mut [u8]) -> io::Result<usize> {
        if let Some((kind, msg)) = &self.failed {
            return Err(io::Error::new(*kind, msg.clone()));
        }
        if out.is_empty() {
            return Ok(0);
        }
        // Empty records (a flush with nothing buffered never makes one, but a peer may) carry
        // nothing: read on.
        while self.plain.is_empty() {
            if !self.next_record(inner)? {
                return Ok(0);
            }
        }
        let n = out.len().min(self.plain.len());
        out[..n].copy_from_slice(&self.buf[self.plain.start..self.plain.start + n]);
        self.plain.start += n;
        Ok(n)
    }
}

/// Plaintext written and not yet sealed, and the sealer.
struct SendState {
    sealer: Sealer,
    /// A record being filled: header room, then plaintext (the tag is added when sealed).
    buf: Vec<u8>,
    /// Sealed bytes not yet written (what a failed write left).
    out: Vec<u8>,
}

impl SendState {
    fn new(sealer: Sealer) -> SendState {
        SendState {
            sealer,
            buf: vec![0; HEADER_LEN],
            out: Vec::new(),
        }
    }

    fn write(&mut self, inner: &mut impl Write, data: &[u8]) -> io::Result<usize> {
        let room = HEADER_LEN + MAX_RECORD - self.buf.len();
        let n = data.len().min(room);
        self.buf.extend_from_slice(&data[..n]);
        if self.buf.len() == HEADER_LEN + MAX_RECORD {
            if let Err(e) = self.seal_buffered() {
                // Not written: the caller may write these bytes again.
                self.buf.truncate(self.buf.len() - n);
                return Err(e);
            }
            self.write_out(inner)?;
        }
        Ok(n)
    }

    /// Seals the plaintext buffered into one record, queued in `out`. On an error (no record
    /// number left) the plaintext stays buffered and nothing is queued.
    fn seal_buffered(&mut self) -> io::Result<()> {
        if self.buf.len() == HEADER_LEN {
            return Ok(());
        }
        let plain = self.buf.len();
        self.buf.resize(plain + TAG_LEN, 0);
        if let Err(e) = self.sealer.seal_record(&mut self.buf) {
            self.buf.truncate(plain);
            return Err(e.into());
        }
        self.out.extend_from_slice(&self.buf);
        self.buf.truncate(HEADER_LEN);
        Ok(())
    }

    fn write_out(&mut self, inner: &mut impl Write) -> io::Result<()> {
        while !self.out.is_empty() {
            match inner.write(&self.out) {
                Ok(0) => return Err(io::ErrorKind::WriteZero.into()),
                Ok(n) => {
                    self.out.drain(..n);
                }
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) => return Err(e),
            }
        }
        Ok(())
    }

    fn flush(&mut self, inner: &mut impl Write) -> io::Result<()> {
        self.seal_buffered()?;
        self.write_out(inner)?;
        inner.flush()
    }
}

/// A blocking stream carried in records both ways: what is written is sealed into records
/// (sent on [`Write::flush`], or whenever [`MAX_RECORD`] bytes are buffered); what is read is
/// plaintext of records that authenticated, nothing else. Errors name the peer.
pub struct SealedStream<S> {
    inner: S,
    recv: RecvState,
    send: SendState,
}

impl<S: Read + Write> SealedStream<S> {
    /// Carries `inner` in records keyed by `session`; `peer` names the other side in errors.
    pub fn new(inner: S, session: Session, peer: impl Into<String>) -> SealedStream<S> {
        SealedStream {
            inner,
            recv: RecvState::new(session.rx, peer.into()),
            send: SendState::new(session.tx),
        }
    }

    /// The stream underneath (to set its timeouts).
    pub fn get_ref(&self) -> &S {
        &self.inner
    }

    /// The stream underneath, mutably. Reading or writing it directly breaks the records.
    pub fn get_mut(&mut self) -> &mut S {
        &mut self.inner
    }

    /// The stream underneath; plaintext buffered and not flushed is lost.
    pub fn into_inner(self) -> S {
        self.inner
    }
}

impl<S: Read + Write> Read for SealedStream<S> {
    fn read(&mut self, out: &mut [u8]) -> io::Result<usize> {
        self.recv.read(&mut self.inner, out)
    }
}

impl<S: Read + Write> Write for SealedStream<S> {
    fn write(&mut self, data: &[u8]) -> io::Result<usize> {
        self.send.write(&mut self.inner, data)
    }

    fn flush(&mut self) -> io::Result<()> {
        self.send.flush(&mut self.inner)
    }
}

/// The reading half of a sealed stream (for a stream read and written by different threads:
/// `&TcpStream` or a `try_clone` in each half).
pub struct SealedReader<R> {
    inner: R,
    recv: RecvState,
}

impl<R: Read> SealedReader<R> {
    /// Opens records from `inner` with `opener` (a [`Session`]'s `rx`); `peer` names the other
    /// side in errors.
    pub fn new(inner: R, opener: Opener, peer: impl Into<String>) -> SealedReader<R> {
        SealedReader {
            inner,
            recv: RecvState::new(opener, peer.into()),
        }
    }

    /// The reader underneath.
    pub fn get_ref(&self) -> &R {
        &self.inner
    }
}

impl<R: Read> Read for SealedReader<R> {
    fn read(&mut self, out: &mut [u8]) -> io::Result<usize> {
        self.recv.read(&mut self.inner, out)
    }
}

/// The writing half of a sealed stream.
pub struct SealedWriter<W> {
    inner: W,
    send: SendState,
}

impl<W: Write> SealedWriter<W> {
    /// Seals what is written into records with `sealer` (a [`Session`]'s `tx`).
    pub fn new(inner: W, sealer: Sealer) -> SealedWriter<W> {
        SealedWriter {
            inner,
            send: SendState::new(sealer),
        }
    }

    /// The writer underneath.
    pub fn get_ref(&self) -> &W {
        &self.inner
    }
}

impl<W: Write> Write for SealedWriter<W> {
    fn write(&mut self, data: &[u8]) -> io::Result<usize> {
        self.send.write(&mut self.inner, data)
    }

    fn flush(&mut self) -> io::Result<()> {
        self.send.flush(&mut self.inner)
    }
}
