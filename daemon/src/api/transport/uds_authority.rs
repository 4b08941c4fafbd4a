//! Clients that send a socket path as the HTTP/2 `:authority` (unix listener only).
//!
//! grpc-core (Python `grpcio`, C++, Ruby, PHP, C#) sends the percent-encoded socket path
//! (`tmp%2Frun%2Ftesserad.sock`) as the `:authority` of every request on a `unix:`
//! channel; grpc-java and older grpc-go send the raw path. A percent sign or a slash is
//! not allowed in a URI host, so h2 answers every such request with
//! `RST_STREAM(PROTOCOL_ERROR)` before tonic sees it, and the client reports
//! `INTERNAL: Stream removed` (hyperium/h2#487 would relax that upstream; it is not
//! merged). h2 has no setting for it, and the header is HPACK-compressed, so it cannot
//! be patched in place: a unix socket has no authority to check anyway, so
//! [`NormalizeAuthority`] sits between the socket and h2.
//!
//! It decodes the connection's first header block. When its `:authority` is valid (or
//! absent: tonic and grpc-go send `localhost`-like values), the block's own bytes go on
//! and the rest of the connection passes through untouched: h2 decodes everything with
//! the same compression context as the client, and the layer costs nothing more.
//! Otherwise it rewrites every header block of the connection: it decodes each with the
//! client's compression context, replaces an `:authority` that is not a valid URI
//! authority with `localhost`, and encodes the block again with a context of its own
//! that h2's decoder follows (a client that sent a valid authority first and an invalid
//! one later on the same connection is refused by h2, as without this layer). Every
//! other frame, and everything the server writes, passes through byte for byte.
//!
//! It fails closed: a block that does not decode, that is too large, or frames out of
//! HTTP/2's order end the connection, as h2 itself would (with a GOAWAY).

use std::io;
use std::pin::Pin;
use std::task::{Context, Poll, ready};

use bytes::{Buf, BufMut, BytesMut};
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tonic::codegen::http::uri::Authority;
use tonic::transport::server::Connected;

/// What a client sends first on an HTTP/2 connection (RFC 9113 §3.4).
const PREFACE: &[u8] = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n";
const FRAME_HEADER_LEN: usize = 9;
const TYPE_HEADERS: u8 = 0x1;
const TYPE_PUSH_PROMISE: u8 = 0x5;
const TYPE_CONTINUATION: u8 = 0x9;
const FLAG_END_STREAM: u8 = 0x1;
const FLAG_END_HEADERS: u8 = 0x4;
const FLAG_PADDED: u8 = 0x8;
const FLAG_PRIORITY: u8 = 0x20;
/// The frames this layer writes are never larger than this: the initial
/// SETTINGS_MAX_FRAME_SIZE, which every HTTP/2 peer accepts.
const MAX_OUT_FRAME: usize = 16_384;
/// The HPACK dynamic table size h2 advertises (the protocol default: tonic does not
/// change it). A client may not grow its table past it.
const HPACK_TABLE_SIZE: usize = 4_096;
/// Largest compressed header block buffered (HEADERS plus its CONTINUATIONs), and
/// largest decoded header list (RFC 7541 sizes: name + value + 32 per field). hyper
/// refuses lists over 16 KiB; these only bound what this layer holds.
const MAX_BLOCK: usize = 256 * 1024;
const MAX_HEADER_LIST: usize = 256 * 1024;
/// What replaces an authority that is not one.
const LOCALHOST: &[u8] = b"localhost";

enum State {
    /// The client's connection preface, not yet complete.
    Preface,
    /// At a frame boundary.
    Frame,
    /// Inside the payload of a frame that passes through: bytes left.
    Payload(usize),
    /// Everything passes through untouched: not HTTP/2 (no preface; h2 refuses it),
    /// or a client whose first header block had a valid authority.
    Raw,
}

#[derive(Clone, Copy, PartialEq, Eq)]
enum Mode {
    /// Before the first complete header block.
    Inspect,
    /// The first block's authority was invalid: every block is re-encoded.
    Rewrite,
}

/// A HEADERS frame whose header block goes on in CONTINUATION frames.
struct OpenBlock {
    stream_id: u32,
    /// END_STREAM and PRIORITY of the HEADERS frame.
    flags: u8,
    /// The 5 priority bytes when PRIORITY is set.
    priority: Option<[u8; 5]>,
    fragment: BytesMut,
    /// The frames as received (kept while inspecting: they may go on as they are).
    raw: BytesMut,
}

/// A server-side connection whose incoming header blocks carry a valid (or no)
/// `:authority`; see the module docs.
pub struct NormalizeAuthority<T> {
    inner: T,
    state: State,
    /// Bytes read from the client, not yet looked at.
    input: BytesMut,
    /// Bytes ready for h2.
    output: BytesMut,
    open: Option<OpenBlock>,
    mode: Mode,
    decoder: loona_hpack::Decoder<'static>,
    encoder: loona_hpack::Encoder<'static>,
    /// The client closed its side.
    eof: bool,
}

impl<T> NormalizeAuthority<T> {
    pub fn new(inner: T) -> Self {
        let mut decoder = loona_hpack::Decoder::new();
        decoder.set_max_allowed_table_size(HPACK_TABLE_SIZE);
        let mut encoder = loona_hpack::Encoder::new();
        encoder.set_max_table_size(HPACK_TABLE_SIZE);
        NormalizeAuthority {
            inner,
            state: State::Preface,
            input: BytesMut::new(),
            output: BytesMut::new(),
            open: None,
            mode: Mode::Inspect,
            decoder,
            encoder,
            eof: false,
        }
    }

    /// Move what can be moved from `input` to `output`.
    fn process(&mut self) -> io::Result<()> {
        loop {
            match self.state {
                State::Raw => {
                    let all = self.input.split();
                    self.output.unsplit(all);
                    return Ok(());
                }
                State::Preface => {
                    let n = self.input.len().min(PREFACE.len());
                    if self.input[..n] != PREFACE[..n] {
                        self.state = State::Raw;
                        continue;
                    }
                    if n < PREFACE.len() {
                        return Ok(());
                    }
                    let preface = self.input.split_to(PREFACE.len());
                    self.output.unsplit(preface);
                    self.state = State::Frame;
                }
                State::Payload(left) => {
                    let n = left.min(self.input.len());
                    let chunk = self.input.split_to(n);
                    self.output.unsplit(chunk);
                    if n < left {
                        self.state = State::Payload(left - n);
                        return Ok(());
                    }
                    self.state = State::Frame;
                }
                State::Frame => {
                    if self.input.len() < FRAME_HEADER_LEN {
                        return Ok(());
                    }
                    let h = &self.input[..FRAME_HEADER_LEN];
                    let len = usize::from(h[0]) << 16 | usize::from(h[1]) << 8 | usize::from(h[2]);
                    let kind = h[3];
                    if self.open.is_some() && kind != TYPE_CONTINUATION {
                        return Err(invalid(
                            "a frame other than CONTINUATION inside a header block",
                        ));
                    }
                    match kind {
                        TYPE_HEADERS | TYPE_CONTINUATION => {
                            if len > MAX_BLOCK {
                                return Err(invalid("header frame larger than the limit"));
                            }
                            if self.input.len() < FRAME_HEADER_LEN + len {
                                self.input
                                    .reserve(FRAME_HEADER_LEN + len - self.input.len());
                                return Ok(());
                            }
                            let frame = self.input.split_to(FRAME_HEADER_LEN + len);
                            self.header_frame(&frame)?;
                        }
                        TYPE_PUSH_PROMISE => {
                            return Err(invalid("a client sent PUSH_PROMISE"));
                        }
                        _ => {
                            let header = self.input.split_to(FRAME_HEADER_LEN);
                            self.output.unsplit(header);
                            self.state = State::Payload(len);
                        }
                    }
                }
            }
        }
    }

    /// A complete HEADERS or CONTINUATION frame (header and payload).
    fn header_frame(&mut self, frame: &[u8]) -> io::Result<()> {
        let kind = frame[3];
        let flags = frame[4];
        let stream_id = u32::from_be_bytes([frame[5], frame[6], frame[7], frame[8]]) & 0x7fff_ffff;
        let mut payload = &frame[FRAME_HEADER_LEN..];
        if kind == TYPE_CONTINUATION {
            let Some(open) = self.open.as_mut() else {
                return Err(invalid("CONTINUATION without an open header block"));
            };
            if open.stream_id != stream_id {
                return Err(invalid("CONTINUATION on another stream"));
            }
            if open.fragment.len() + payload.len() > MAX_BLOCK {
                return Err(invalid("header block larger than the limit"));
            }
            open.fragment.extend_from_slice(payload);
            if self.mode == Mode::Inspect {
                open.raw.extend_from_slice(frame);
            }
            if flags & FLAG_END_HEADERS != 0
                && let Some(open) = self.open.take()
            {
                self.finish(open)?;
            }
            return Ok(());
        }
        // HEADERS: [pad length] [priority (5)] fragment [padding]
        let mut pad = 0;
        if flags & FLAG_PADDED != 0 {
            let Some((&p, rest)) = payload.split_first() else {
                return Err(invalid("PADDED HEADERS frame without a pad length"));
            };
            pad = usize::from(p);
            payload = rest;
        }
        let mut priority = None;
        if flags & FLAG_PRIORITY != 0 {
            let Some((p, rest)) = payload.split_first_chunk::<5>() else {
                return Err(invalid("PRIORITY HEADERS frame too short"));
            };
            priority = Some(*p);
            payload = rest;
        }
        if pad > payload.len() {
            return Err(invalid("HEADERS padding longer than the frame"));
        }
        let fragment = BytesMut::from(&payload[..payload.len() - pad]);
        let raw = if self.mode == Mode::Inspect {
            BytesMut::from(frame)
        } else {
            BytesMut::new()
        };
        let open = OpenBlock {
            stream_id,
            flags: flags & (FLAG_END_STREAM | FLAG_PRIORITY),
            priority,
            fragment,
            raw,
        };
        if flags & FLAG_END_HEADERS != 0 {
            self.finish(open)
        } else {
            self.open = Some(open);
            Ok(())
        }
    }

    /// Decode a complete header block, fix its authority, encode it again and queue
    /// it as HEADERS (+ CONTINUATION) frames; or, for a first block that needs no fix,
    /// queue it as received and pass the rest of the connection through.
    fn finish(&mut self, mut block: OpenBlock) -> io::Result<()> {
        // A connection's first block decodes with an empty dynamic table, so the
        // same bytes always give the same fields: a block seen to pass before
        // passes again without decoding (each Huffman string costs the decoder a
        // table of its own; every runtime start opens a connection).
        if self.mode == Mode::Inspect && first_blocks_passed().contains(&block.fragment) {
            let raw = block.raw.split();
            self.output.unsplit(raw);
            self.state = State::Raw;
            return Ok(());
        }
        let mut fields: Vec<(Vec<u8>, Vec<u8>)> = Vec::new();
        let mut size = 0usize;
        let mut fixed = false;
        self.decoder
            .decode_with_cb(&block.fragment, |name, value| {
                // Keep decoding past the limit: the table must see every field.
                size = size.saturating_add(name.len() + value.len() + 32);
                if size > MAX_HEADER_LIST {
                    return;
                }
                let value = if &*name == b":authority" && Authority::try_from(&*value).is_err() {
                    fixed = true;
                    LOCALHOST.to_vec()
                } else {
                    value.into_owned()
                };
                fields.push((name.into_owned(), value));
            })
            .map_err(|e| invalid(&format!("header block does not decode: {e}")))?;
        if size > MAX_HEADER_LIST {
            return Err(invalid("header list larger than the limit"));
        }
        if self.mode == Mode::Inspect {
            if !fixed {
                first_blocks_passed().remember(&block.fragment);
                let raw = block.raw.split();
                self.output.unsplit(raw);
                self.state = State::Raw;
                return Ok(());
            }
            self.mode = Mode::Rewrite;
        }
        let mut encoded = Vec::with_capacity(block.fragment.len() + 16);
        self.encoder
            .encode_into(
                fields.iter().map(|(n, v)| (n.as_slice(), v.as_slice())),
                &mut encoded,
            )
            .map_err(|e| invalid(&format!("header block does not encode: {e}")))?;

        let priority: &[u8] = match &block.priority {
            Some(p) => p,
            None => &[],
        };
        let first = encoded.len().min(MAX_OUT_FRAME - priority.len());
        let (head, mut rest) = encoded.split_at(first);
        let end_headers = if rest.is_empty() { FLAG_END_HEADERS } else { 0 };
        self.put_frame(
            TYPE_HEADERS,
            block.flags | end_headers,
            block.stream_id,
            &[priority, head],
        );
        while !rest.is_empty() {
            let (chunk, tail) = rest.split_at(rest.len().min(MAX_OUT_FRAME));
            let end_headers = if tail.is_empty() { FLAG_END_HEADERS } else { 0 };
            self.put_frame(TYPE_CONTINUATION, end_headers, block.stream_id, &[chunk]);
            rest = tail;
        }
        Ok(())
    }

    fn put_frame(&mut self, kind: u8, flags: u8, stream_id: u32, parts: &[&[u8]]) {
        let len: usize = parts.iter().map(|p| p.len()).sum();
        self.output.reserve(FRAME_HEADER_LEN + len);
        // len <= MAX_OUT_FRAME < 2^24: three bytes hold it.
        self.output.put_uint(len as u64, 3);
        self.output.put_u8(kind);
        self.output.put_u8(flags);
        self.output.put_u32(stream_id);
        for p in parts {
            self.output.put_slice(p);
        }
    }
}

/// First header blocks that passed inspection untouched, most recent last.
struct PassedBlocks(std::sync::Mutex<std::collections::VecDeque<Vec<u8>>>);

/// How many first blocks are remembered (one per client kind and first call, in
/// practice), and the longest remembered.
const PASSED_BLOCKS: usize = 32;
const PASSED_BLOCK_MAX: usize = 2048;

impl PassedBlocks {
    fn contains(&self, block: &[u8]) -> bool {
        let list = self.0.lock().unwrap_or_else(|p| p.into_inner());
        list.iter().any(|b| b.as_slice() == block)
    }

    fn remember(&self, block: &[u8]) {
        if block.len() > PASSED_BLOCK_MAX {
            return;
        }
        let mut list = self.0.lock().unwrap_or_else(|p| p.into_inner());
        if list.iter().any(|b| b.as_slice() == block) {
            return;
        }
        if list.len() == PASSED_BLOCKS {
            list.pop_front();
        }
        list.push_back(block.to_vec());
    }
}

fn first_blocks_passed() -> &'static PassedBlocks {
    static PASSED: std::sync::OnceLock<PassedBlocks> = std::sync::OnceLock::new();
    PASSED.get_or_init(|| PassedBlocks(std::sync::Mutex::new(std::collections::VecDeque::new())))
}

fn invalid(what: &str) -> io::Error {
    io::Error::new(
        io::ErrorKind::InvalidData,
        format!("HTTP/2 from a unix-socket client: {what}"),
    )
}

impl<T: AsyncRead + Unpin> AsyncRead for NormalizeAuthority<T> {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let this = &mut *self;
        loop {
            if !this.output.is_empty() {
                let n = this.output.len().min(buf.remaining());
                buf.put_slice(&this.output[..n]);
                this.output.advance(n);
                return Poll::Ready(Ok(()));
            }
            if matches!(this.state, State::Raw) && this.input.is_empty() {
                // Nothing left to look at: straight from the socket.
                return Pin::new(&mut this.inner).poll_read(cx, buf);
            }
            if this.eof {
                // A frame cut short by the client's close is dropped: h2 sees the
                // end of the stream at a frame boundary and closes.
                return Poll::Ready(Ok(()));
            }
            let mut chunk = [0u8; 8192];
            let mut read = ReadBuf::new(&mut chunk);
            ready!(Pin::new(&mut this.inner).poll_read(cx, &mut read))?;
            if read.filled().is_empty() {
                this.eof = true;
                continue;
            }
            this.input.extend_from_slice(read.filled());
            this.process()?;
        }
    }
}

impl<T: AsyncWrite + Unpin> AsyncWrite for NormalizeAuthority<T> {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.inner).poll_write(cx, buf)
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.inner).poll_write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        self.inner.is_write_vectored()
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_shutdown(cx)
    }
}

/// The caller's identity (peer credentials and groups) comes from the socket
/// underneath, and whether it is inside a container is looked at here, once per
/// connection.
impl<T> Connected for NormalizeAuthority<T>
where
    T: Connected<ConnectInfo = tonic::transport::server::UdsConnectInfo> + std::os::fd::AsFd,
{
    type ConnectInfo = crate::api::auth::UnixPeer;

    fn connect_info(&self) -> Self::ConnectInfo {
        crate::api::auth::UnixPeer::accepted(self.inner.connect_info(), self.inner.as_fd())
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used)]

    use super::*;
    use tokio::io::AsyncReadExt;

    fn frame(kind: u8, flags: u8, stream_id: u32, payload: &[u8]) -> Vec<u8> {
        let mut f = Vec::new();
        f.extend_from_slice(&(payload.len() as u32).to_be_bytes()[1..]);
        f.push(kind);
        f.push(flags);
        f.extend_from_slice(&stream_id.to_be_bytes());
        f.extend_from_slice(payload);
        f
    }

    /// A request's header block as grpc-core encodes it on a unix channel.
    fn request(authority: &str) -> Vec<(Vec<u8>, Vec<u8>)> {
        [
            (":method", "POST"),
            (":scheme", "http"),
            (":path", "/tessera.v1.Tessera/GetNode"),
            (":authority", authority),
            ("te", "trailers"),
            ("content-type", "application/grpc"),
            (
                "user-agent",
                "grpc-python/1.85.1 grpc-c/58.0.0 (linux; chttp2)",
            ),
        ]
        .iter()
        .map(|(n, v)| (n.as_bytes().to_vec(), v.as_bytes().to_vec()))
        .collect()
    }

    fn encode(enc: &mut loona_hpack::Encoder<'static>, fields: &[(Vec<u8>, Vec<u8>)]) -> Vec<u8> {
        enc.encode(fields.iter().map(|(n, v)| (n.as_slice(), v.as_slice())))
    }

    /// Run `input` through the layer, fed `chunk` bytes per read, and return what h2
    /// would read.
    async fn through(input: &[u8], chunk: usize) -> io::Result<Vec<u8>> {
        let (mut client, server) = tokio::io::duplex(1 << 20);
        let mut layer = NormalizeAuthority::new(server);
        let data = input.to_vec();
        let writer = tokio::spawn(async move {
            use tokio::io::AsyncWriteExt;
            for c in data.chunks(chunk) {
                client.write_all(c).await.unwrap();
                client.flush().await.unwrap();
                tokio::task::yield_now().await;
            }
            client.shutdown().await.unwrap();
        });
        let mut out = Vec::new();
        let res = layer.read_to_end(&mut out).await;
        writer.await.unwrap();
        res.map(|_| out)
    }

    /// Split h2's input into frames and decode every header block in order, as h2's
    /// own decoder would: (type, flags, stream, decoded headers or raw payload).
    struct Seen {
        kind: u8,
        flags: u8,
        stream_id: u32,
        payload: Vec<u8>,
        headers: Vec<(Vec<u8>, Vec<u8>)>,
    }

    fn parse(out: &[u8]) -> Vec<Seen> {
        assert!(out.starts_with(PREFACE), "the preface passes through");
        let mut rest = &out[PREFACE.len()..];
        let mut dec = loona_hpack::Decoder::new();
        let mut seen: Vec<Seen> = Vec::new();
        let mut block = Vec::new();
        while !rest.is_empty() {
            let len = usize::from(rest[0]) << 16 | usize::from(rest[1]) << 8 | usize::from(rest[2]);
            assert!(
                len <= MAX_OUT_FRAME || rest[3] == 0x0,
                "frame of {len} bytes"
            );
            let kind = rest[3];
            let flags = rest[4];
            let stream_id = u32::from_be_bytes([rest[5], rest[6], rest[7], rest[8]]);
            let payload = rest[9..9 + len].to_vec();
            rest = &rest[9 + len..];
            let mut headers = Vec::new();
            if kind == TYPE_HEADERS || kind == TYPE_CONTINUATION {
                assert_eq!(flags & FLAG_PADDED, 0, "padding is dropped");
                let skip = if kind == TYPE_HEADERS && flags & FLAG_PRIORITY != 0 {
                    5
                } else {
                    0
                };
                block.extend_from_slice(&payload[skip..]);
                if flags & FLAG_END_HEADERS != 0 {
                    headers = dec.decode(&block).unwrap();
                    block.clear();
                }
            }
            seen.push(Seen {
                kind,
                flags,
                stream_id,
                payload,
                headers,
            });
        }
        assert!(block.is_empty(), "a header block is left open");
        seen
    }

    fn authority(headers: &[(Vec<u8>, Vec<u8>)]) -> Option<String> {
        headers
            .iter()
            .find(|(n, _)| n == b":authority")
            .map(|(_, v)| String::from_utf8(v.clone()).unwrap())
    }

    #[tokio::test]
    async fn a_socket_path_authority_becomes_localhost_and_the_rest_is_kept() {
        let mut enc = loona_hpack::Encoder::new();
        let mut input = PREFACE.to_vec();
        input.extend(frame(0x4, 0, 0, &[0, 3, 0, 0, 0, 100])); // SETTINGS
        let req = request("tmp%2Frun%2Ftesserad.sock");
        input.extend(frame(
            TYPE_HEADERS,
            FLAG_END_HEADERS,
            1,
            &encode(&mut enc, &req),
        ));
        let data = frame(0x0, FLAG_END_STREAM, 1, &[0, 0, 0, 0, 2, 8, 1]);
        input.extend(&data);
        // The second request's block refers to the first one's dynamic table entries.
        let req2 = request("%2Fvar%2Frun%2Ftessera%2Ftesserad.sock");
        let block2 = encode(&mut enc, &req2);
        input.extend(frame(
            TYPE_HEADERS,
            FLAG_END_HEADERS | FLAG_END_STREAM,
            3,
            &block2,
        ));
        // A valid authority is left alone.
        let req3 = request("localhost:50051");
        input.extend(frame(
            TYPE_HEADERS,
            FLAG_END_HEADERS | FLAG_END_STREAM,
            5,
            &encode(&mut enc, &req3),
        ));

        for chunk in [input.len(), 7, 1] {
            let out = through(&input, chunk).await.unwrap();
            let seen = parse(&out);
            assert_eq!(seen.len(), 5, "chunk {chunk}");
            assert_eq!(seen[0].kind, 0x4);
            assert_eq!(
                seen[0].payload,
                [0, 3, 0, 0, 0, 100],
                "SETTINGS byte for byte"
            );
            assert_eq!(authority(&seen[1].headers).as_deref(), Some("localhost"));
            let mut want = request("localhost");
            assert_eq!(seen[1].headers, want, "every other field as sent, in order");
            assert_eq!(seen[1].flags, FLAG_END_HEADERS);
            assert_eq!(seen[1].stream_id, 1);
            assert_eq!(seen[2].payload, data[9..], "DATA byte for byte");
            assert_eq!(seen[2].flags, FLAG_END_STREAM);
            assert_eq!(seen[3].headers, want);
            assert_eq!(seen[3].flags, FLAG_END_HEADERS | FLAG_END_STREAM);
            assert_eq!(seen[3].stream_id, 3);
            want = request("localhost:50051");
            assert_eq!(seen[4].headers, want);
        }
    }

    #[tokio::test]
    async fn padding_priority_and_continuation_frames_are_handled() {
        let mut enc = loona_hpack::Encoder::new();
        let mut fields = request("/run/tesserad.sock");
        // A large field forces the rewritten block over one frame.
        fields.push((b"x-big".to_vec(), vec![b'a'; 20_000]));
        let block = encode(&mut enc, &fields);
        let (a, b) = block.split_at(100);
        let (b, c) = b.split_at(10_000);
        let mut headers = vec![4u8]; // pad length
        headers.extend([0x80, 0, 0, 0, 15]); // exclusive dependency on 0, weight 15
        headers.extend(a);
        headers.extend([0u8; 4]); // padding
        let mut input = PREFACE.to_vec();
        input.extend(frame(
            TYPE_HEADERS,
            FLAG_PADDED | FLAG_PRIORITY,
            7,
            &headers,
        ));
        input.extend(frame(TYPE_CONTINUATION, 0, 7, b));
        input.extend(frame(TYPE_CONTINUATION, FLAG_END_HEADERS, 7, c));

        let out = through(&input, 1000).await.unwrap();
        let seen = parse(&out);
        assert!(seen.len() >= 2, "a block over 16 KiB is split");
        assert_eq!(seen[0].kind, TYPE_HEADERS);
        assert_eq!(
            seen[0].flags, FLAG_PRIORITY,
            "priority kept, padding dropped"
        );
        assert_eq!(seen[0].payload[..5], [0x80, 0, 0, 0, 15]);
        assert!(
            seen[1..]
                .iter()
                .all(|s| s.kind == TYPE_CONTINUATION && s.stream_id == 7)
        );
        let last = seen.last().unwrap();
        assert_eq!(last.flags, FLAG_END_HEADERS);
        let mut want = request("localhost");
        want.push((b"x-big".to_vec(), vec![b'a'; 20_000]));
        assert_eq!(last.headers, want);
    }

    #[tokio::test]
    async fn out_of_order_or_undecodable_input_ends_the_connection() {
        let mut enc = loona_hpack::Encoder::new();
        let block = encode(&mut enc, &request("x"));
        let cases: Vec<(&str, Vec<u8>)> = vec![
            (
                "stray CONTINUATION",
                frame(TYPE_CONTINUATION, FLAG_END_HEADERS, 1, &block),
            ),
            (
                "DATA inside a header block",
                [frame(TYPE_HEADERS, 0, 1, &block), frame(0x0, 0, 1, b"x")].concat(),
            ),
            (
                "CONTINUATION on another stream",
                [
                    frame(TYPE_HEADERS, 0, 1, &block),
                    frame(TYPE_CONTINUATION, FLAG_END_HEADERS, 3, b""),
                ]
                .concat(),
            ),
            (
                "PUSH_PROMISE",
                frame(TYPE_PUSH_PROMISE, FLAG_END_HEADERS, 1, &[0, 0, 0, 2]),
            ),
            ("index 0", frame(TYPE_HEADERS, FLAG_END_HEADERS, 1, &[0x80])),
            (
                "index past the tables",
                frame(TYPE_HEADERS, FLAG_END_HEADERS, 1, &[0xff, 0x7f]),
            ),
            (
                "table size over 4096",
                frame(TYPE_HEADERS, FLAG_END_HEADERS, 1, &[0x3f, 0xe2, 0x1f, 0x82]),
            ),
            (
                "padding past the end",
                frame(TYPE_HEADERS, FLAG_PADDED | FLAG_END_HEADERS, 1, &[9, 0x82]),
            ),
        ];
        for (what, bytes) in cases {
            let input = [PREFACE, &bytes].concat();
            let err = through(&input, input.len()).await.expect_err(what);
            assert_eq!(err.kind(), io::ErrorKind::InvalidData, "{what}: {err}");
        }
        // A decoded list past the limit: one 4 KiB entry, then 100 references to it.
        let mut enc = loona_hpack::Encoder::new();
        let mut block = encode(&mut enc, &[(b"x-a".to_vec(), vec![b'a'; 4000])]);
        block.extend([0x80 | 62; 100]);
        let input = [PREFACE, &frame(TYPE_HEADERS, FLAG_END_HEADERS, 1, &block)].concat();
        let err = through(&input, input.len()).await.unwrap_err();
        assert!(err.to_string().contains("larger than the limit"), "{err}");
    }

    #[tokio::test]
    async fn a_connection_whose_first_authority_is_valid_passes_through_untouched() {
        let mut enc = loona_hpack::Encoder::new();
        let mut input = PREFACE.to_vec();
        input.extend(frame(0x4, 0, 0, &[]));
        let block = encode(&mut enc, &request("[::]:50051"));
        // Split over a CONTINUATION: the frames go on as they came.
        input.extend(frame(TYPE_HEADERS, 0, 1, &block[..5]));
        input.extend(frame(TYPE_CONTINUATION, FLAG_END_HEADERS, 1, &block[5..]));
        input.extend(frame(0x0, FLAG_END_STREAM, 1, &[0, 0, 0, 0, 0]));
        // Later blocks are not looked at (h2 would refuse this one, as without the layer).
        let later = encode(&mut enc, &request("tmp%2Fx.sock"));
        input.extend(frame(
            TYPE_HEADERS,
            FLAG_END_HEADERS | FLAG_END_STREAM,
            3,
            &later,
        ));
        for chunk in [input.len(), 5, 1] {
            assert_eq!(
                through(&input, chunk).await.unwrap(),
                input,
                "chunk {chunk}"
            );
        }
    }

    /// A first block that passed once is remembered and passes again without being
    /// decoded; one that needed its authority fixed is never remembered, and is
    /// fixed on every connection.
    #[tokio::test]
    async fn first_blocks_that_passed_are_remembered_and_fixed_ones_never() {
        let mut enc = loona_hpack::Encoder::new();
        let good = encode(&mut enc, &request("remembered.test:1"));
        let input = [PREFACE, &frame(TYPE_HEADERS, FLAG_END_HEADERS, 1, &good)].concat();
        assert_eq!(through(&input, input.len()).await.unwrap(), input);
        assert!(first_blocks_passed().contains(&good));
        assert_eq!(
            through(&input, 7).await.unwrap(),
            input,
            "again, from memory"
        );

        let mut enc = loona_hpack::Encoder::new();
        let bad = encode(&mut enc, &request("tmp%2Fremembered.sock"));
        let input = [PREFACE, &frame(TYPE_HEADERS, FLAG_END_HEADERS, 1, &bad)].concat();
        for _ in 0..2 {
            let out = through(&input, input.len()).await.unwrap();
            let seen = parse(&out);
            assert_eq!(seen.len(), 1);
            assert_eq!(authority(&seen[0].headers).as_deref(), Some("localhost"));
        }
        assert!(!first_blocks_passed().contains(&bad));
    }

    #[tokio::test]
    async fn anything_but_http2_passes_through_untouched() {
        let input = b"GET / HTTP/1.1\r\nHost: /tmp/x.sock\r\n\r\n".to_vec();
        assert_eq!(through(&input, 3).await.unwrap(), input);
    }

    proptest::proptest! {
        /// Arbitrary header blocks and frames never panic the layer.
        #[test]
        fn arbitrary_input_never_panics(
            flags in proptest::num::u8::ANY,
            block in proptest::collection::vec(proptest::num::u8::ANY, 0..512),
            tail in proptest::collection::vec(proptest::num::u8::ANY, 0..512),
        ) {
            let rt = tokio::runtime::Builder::new_current_thread().build().unwrap();
            let input = [PREFACE, &frame(TYPE_HEADERS, flags, 1, &block), &tail].concat();
            let _ = rt.block_on(through(&input, 13));
        }
    }
}
