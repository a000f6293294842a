//! TLS on a link: TLS 1.3 (rustls, ring provider) with one cluster certificate that
//! every node holds. Both ends present it and accept exactly a peer that presents it
//! (the certificate is pinned: no CA, no host names, no expiry), so TLS adds
//! encryption and a second, certificate-based, proof of membership under the token
//! handshake, which runs inside TLS unchanged.
//!
//! A link's two halves are used from two threads. They share one rustls connection
//! behind a mutex that is held only to encrypt or decrypt, never while a socket blocks:
//! the writer seals a frame under the lock and writes it with one `write_all` (a large
//! frame in pieces); the reader waits on its own clone of the socket, then takes the
//! lock to decrypt what arrived. Holding the lock across socket I/O could deadlock two nodes whose writers
//! each wait for the other's reader.

use std::io::{self, IoSlice, Read, Write};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use rustls::client::danger::{HandshakeSignatureValid, ServerCertVerified, ServerCertVerifier};
use rustls::crypto::{verify_tls12_signature, verify_tls13_signature, WebPkiSupportedAlgorithms};
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer, ServerName, UnixTime};
use rustls::server::danger::{ClientCertVerified, ClientCertVerifier};
use rustls::{
    AlertDescription, CertificateError, ClientConfig, ClientConnection, Connection, DigitallySignedStruct,
    DistinguishedName, InconsistentKeys, OtherError, ServerConfig, ServerConnection, SignatureScheme,
};

use crate::framed::{read_error, Bounded, Stream};
use crate::NetError;

/// The name a client asks for. The pinned verifiers ignore it; rustls needs one.
const SERVER_NAME: &str = "baton-cluster";

/// Longest a TLS handshake may take when the link has no read timeout of its own.
pub(crate) const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);

/// Ciphertext read from the socket per system call.
const READ_CHUNK: usize = 64 << 10;

/// Most plaintext sealed before it is written. A token's frame and a prompt chunk's
/// hidden states (64 tokens of qwen2) leave in one write; a streamed tensor chunk goes
/// in pieces, so the peer decrypts one piece while this end seals the next (on
/// loopback this cuts what TLS adds to an 8 MiB frame from about 17 ms to 5 ms).
const SEAL_CHUNK: usize = 256 << 10;

/// Why a certificate or key cannot be used; each names the file.
#[derive(Debug, thiserror::Error)]
pub enum TlsError {
    /// The file could not be read.
    #[error("cannot read {path}: {source}")]
    Read { path: PathBuf, source: io::Error },
    /// The file is not PEM, or holds no section of the kind needed.
    #[error("{path} holds no PEM {what} ({reason})")]
    Pem {
        path: PathBuf,
        what: &'static str,
        reason: String,
    },
    /// The key is not the certificate's.
    #[error("the key in {key} does not belong to the certificate in {cert}")]
    KeyMismatch { cert: PathBuf, key: PathBuf },
    /// rustls refused the pair (unsupported key type, malformed certificate).
    #[error("cannot use {cert} with {key}: {reason}")]
    Unusable {
        cert: PathBuf,
        key: PathBuf,
        reason: String,
    },
}

/// The cluster certificate and its key, ready for both ends of a link. Build it once
/// and share it (`Arc`) between links.
pub struct TlsConfig {
    client: Arc<ClientConfig>,
    server: Arc<ServerConfig>,
}

impl std::fmt::Debug for TlsConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("TlsConfig { .. }")
    }
}

impl TlsConfig {
    /// Loads the cluster certificate (PEM; the first certificate is the one pinned) and
    /// its private key (PEM: PKCS#8, PKCS#1 or SEC1).
    pub fn from_pem_files(cert: &Path, key: &Path) -> Result<TlsConfig, TlsError> {
        let read = |path: &Path| {
            std::fs::read(path).map_err(|source| TlsError::Read {
                path: path.to_path_buf(),
                source,
            })
        };
        TlsConfig::from_pem(&read(cert)?, cert, &read(key)?, key)
    }

    /// Like [`TlsConfig::from_pem_files`], from PEM text already read; the paths only
    /// name the sources in errors.
    pub fn from_pem(cert_pem: &[u8], cert: &Path, key_pem: &[u8], key: &Path) -> Result<TlsConfig, TlsError> {
        let chain = parse_certs(cert_pem, cert)?;
        let private = PrivateKeyDer::from_pem_slice(key_pem).map_err(|e| TlsError::Pem {
            path: key.to_path_buf(),
            what: "private key",
            reason: e.to_string(),
        })?;
        let pinned = chain[0].clone();
        TlsConfig::build(chain, private, pinned).map_err(|e| match e {
            rustls::Error::InconsistentKeys(InconsistentKeys::KeyMismatch) => TlsError::KeyMismatch {
                cert: cert.to_path_buf(),
                key: key.to_path_buf(),
            },
            other => TlsError::Unusable {
                cert: cert.to_path_buf(),
                key: key.to_path_buf(),
                reason: other.to_string(),
            },
        })
    }

    /// Presents `chain` (signed with `key`) and accepts peers that present `pinned`.
    /// Normally `pinned` is the first of `chain`; tests pin another to play a node of
    /// another cluster.
    fn build(
        chain: Vec<CertificateDer<'static>>,
        key: PrivateKeyDer<'static>,
        pinned: CertificateDer<'static>,
    ) -> Result<TlsConfig, rustls::Error> {
        let provider = Arc::new(rustls::crypto::ring::default_provider());
        let verifier = Arc::new(PinnedCert {
            cert: pinned,
            algorithms: provider.signature_verification_algorithms,
        });
        let mut client = ClientConfig::builder_with_provider(provider.clone())
            .with_protocol_versions(&[&rustls::version::TLS13])?
            .dangerous()
            .with_custom_certificate_verifier(verifier.clone())
            .with_client_auth_cert(chain.clone(), key.clone_key())?;
        // Links are long-lived; resuming sessions would only add tickets to the wire.
        client.resumption = rustls::client::Resumption::disabled();
        let mut server = ServerConfig::builder_with_provider(provider)
            .with_protocol_versions(&[&rustls::version::TLS13])?
            .with_client_cert_verifier(verifier)
            .with_single_cert(chain, key)?;
        server.send_tls13_tickets = 0;
        Ok(TlsConfig {
            client: Arc::new(client),
            server: Arc::new(server),
        })
    }

    #[cfg(test)]
    pub(crate) fn pinning(cert_pem: &str, key_pem: &str, pinned_pem: &str) -> TlsConfig {
        let path = Path::new("test");
        let chain = parse_certs(cert_pem.as_bytes(), path).unwrap();
        let pinned = parse_certs(pinned_pem.as_bytes(), path).unwrap().remove(0);
        TlsConfig::build(
            chain,
            PrivateKeyDer::from_pem_slice(key_pem.as_bytes()).unwrap(),
            pinned,
        )
        .unwrap()
    }
}

fn parse_certs(pem: &[u8], path: &Path) -> Result<Vec<CertificateDer<'static>>, TlsError> {
    let error = |reason: String| TlsError::Pem {
        path: path.to_path_buf(),
        what: "certificate",
        reason,
    };
    let chain = CertificateDer::pem_slice_iter(pem)
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| error(e.to_string()))?;
    if chain.is_empty() {
        return Err(error("no -----BEGIN CERTIFICATE----- section".into()));
    }
    Ok(chain)
}

/// Accepts exactly the peer whose end-entity certificate is `cert`, on either side of
/// the handshake. The handshake signatures are still checked, so the peer must also
/// hold the certificate's key.
#[derive(Debug)]
struct PinnedCert {
    cert: CertificateDer<'static>,
    algorithms: WebPkiSupportedAlgorithms,
}

/// What a pinned verifier says about a certificate that is not the cluster's.
#[derive(Debug, thiserror::Error)]
#[error("not the cluster certificate")]
struct NotClusterCert;

impl PinnedCert {
    fn check(&self, end_entity: &CertificateDer<'_>) -> Result<(), rustls::Error> {
        if end_entity.as_ref() == self.cert.as_ref() {
            return Ok(());
        }
        Err(rustls::Error::InvalidCertificate(CertificateError::Other(OtherError(
            Arc::new(NotClusterCert),
        ))))
    }
}

impl ServerCertVerifier for PinnedCert {
    fn verify_server_cert(
        &self,
        end_entity: &CertificateDer<'_>,
        _intermediates: &[CertificateDer<'_>],
        _server_name: &ServerName<'_>,
        _ocsp_response: &[u8],
        _now: UnixTime,
    ) -> Result<ServerCertVerified, rustls::Error> {
        self.check(end_entity).map(|()| ServerCertVerified::assertion())
    }

    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        verify_tls12_signature(message, cert, dss, &self.algorithms)
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        verify_tls13_signature(message, cert, dss, &self.algorithms)
    }

    fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
        self.algorithms.supported_schemes()
    }
}

impl ClientCertVerifier for PinnedCert {
    fn root_hint_subjects(&self) -> &[DistinguishedName] {
        &[]
    }

    fn verify_client_cert(
        &self,
        end_entity: &CertificateDer<'_>,
        _intermediates: &[CertificateDer<'_>],
        _now: UnixTime,
    ) -> Result<ClientCertVerified, rustls::Error> {
        self.check(end_entity).map(|()| ClientCertVerified::assertion())
    }

    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        verify_tls12_signature(message, cert, dss, &self.algorithms)
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        verify_tls13_signature(message, cert, dss, &self.algorithms)
    }

    fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
        self.algorithms.supported_schemes()
    }
}

/// One half's view of a TLS connection: the shared rustls state, plus what only this
/// half touches (ciphertext read but not yet decrypted, or sealed but not yet sent).
pub(crate) struct TlsSession {
    conn: Arc<Mutex<Connection>>,
    /// Ciphertext read from the socket (empty until this half first reads).
    incoming: Vec<u8>,
    /// `incoming[start..end]` is still to be handed to rustls.
    start: usize,
    end: usize,
    /// Ciphertext sealed and not yet written.
    sealed: Vec<u8>,
}

impl TlsSession {
    /// Runs the client side of the handshake on `stream`, done by `deadline`; the
    /// stream's reads then wait at most `timeout` again.
    pub(crate) fn client<S: Stream>(
        stream: &mut S,
        config: &TlsConfig,
        peer: &str,
        deadline: Instant,
        timeout: Option<Duration>,
    ) -> Result<TlsSession, NetError> {
        let name = ServerName::try_from(SERVER_NAME).expect("a valid DNS name");
        let conn = ClientConnection::new(config.client.clone(), name).map_err(|e| tls_error(peer, &e))?;
        TlsSession::handshake(stream, conn.into(), peer, deadline, timeout)
    }

    /// Runs the server side of the handshake on an accepted `stream`, of which
    /// `already_read` are the first bytes (read to tell TLS from plain frames), done by
    /// `deadline`.
    pub(crate) fn server<S: Stream>(
        stream: &mut S,
        config: &TlsConfig,
        peer: &str,
        deadline: Instant,
        timeout: Option<Duration>,
        mut already_read: &[u8],
    ) -> Result<TlsSession, NetError> {
        let mut conn = ServerConnection::new(config.server.clone()).map_err(|e| tls_error(peer, &e))?;
        while !already_read.is_empty() {
            conn.read_tls(&mut already_read).map_err(|e| handshake_error(peer, e))?;
        }
        TlsSession::handshake(stream, conn.into(), peer, deadline, timeout)
    }

    /// Runs the handshake to its end or `deadline`, whichever comes first. rustls's
    /// `complete_io` reads until the handshake is done, so the deadline must bound each
    /// read (`Bounded`), not the loop: checked between calls, a peer dripping a byte per
    /// read timeout kept it going for as long as it liked (issue 16).
    fn handshake<S: Stream>(
        stream: &mut S,
        mut conn: Connection,
        peer: &str,
        deadline: Instant,
        timeout: Option<Duration>,
    ) -> Result<TlsSession, NetError> {
        let io = |source| NetError::Io {
            peer: peer.to_string(),
            source,
        };
        {
            let mut bounded = Bounded::new(stream, deadline, None);
            while conn.is_handshaking() {
                if let Err(e) = conn.complete_io(&mut bounded) {
                    return Err(handshake_error(peer, e));
                }
            }
        }
        stream.set_read_timeout(timeout).map_err(io)?;
        // Up to SEAL_CHUNK is sealed before it is written; rustls's default limit
        // (64 KiB) would make it take only part of that.
        conn.set_buffer_limit(None);
        Ok(TlsSession {
            conn: Arc::new(Mutex::new(conn)),
            incoming: Vec::new(),
            start: 0,
            end: 0,
            sealed: Vec::new(),
        })
    }

    /// A session for the other half of the same connection.
    pub(crate) fn half(&self) -> TlsSession {
        TlsSession {
            conn: self.conn.clone(),
            incoming: Vec::new(),
            start: 0,
            end: 0,
            sealed: Vec::new(),
        }
    }

    /// Seals `parts` as one run of records and writes them with one `write_all`; a frame
    /// longer than [`SEAL_CHUNK`] goes out one chunk at a time, so that the peer
    /// decrypts a chunk while this end seals the next.
    pub(crate) fn send(&mut self, stream: &mut impl Write, parts: &[IoSlice<'_>], peer: &str) -> Result<(), NetError> {
        let mut parts = parts.to_vec();
        let mut rest: &mut [IoSlice] = &mut parts;
        while !rest.is_empty() {
            self.sealed.clear();
            {
                let mut conn = self.conn.lock().unwrap_or_else(|p| p.into_inner());
                // Without a buffer limit rustls takes all it is given; a fatal error
                // the reader met shows here as an error.
                let n = conn
                    .writer()
                    .write_vectored(&prefix(rest, SEAL_CHUNK))
                    .map_err(|e| write_error(peer, e))?;
                if n == 0 {
                    return Err(NetError::Closed { peer: peer.to_string() });
                }
                IoSlice::advance_slices(&mut rest, n);
                while conn.wants_write() {
                    conn.write_tls(&mut self.sealed).map_err(|e| write_error(peer, e))?;
                }
            }
            stream.write_all(&self.sealed).map_err(|source| NetError::Io {
                peer: peer.to_string(),
                source,
            })?;
        }
        Ok(())
    }

    /// Fills `dst` with plaintext, waiting on the socket (without the lock) when
    /// nothing decrypted is left.
    pub(crate) fn read_exact(&mut self, stream: &mut impl Read, dst: &mut [u8], peer: &str) -> Result<(), NetError> {
        let mut filled = 0;
        while filled < dst.len() {
            if let Some(n) = self.decrypt_into(&mut dst[filled..], peer)? {
                filled += n;
                continue;
            }
            // Only a half that reads needs the buffer.
            self.incoming.resize(READ_CHUNK, 0);
            let n = stream.read(&mut self.incoming).map_err(|e| read_error(peer, e))?;
            if n == 0 {
                return Err(NetError::Closed { peer: peer.to_string() });
            }
            (self.start, self.end) = (0, n);
        }
        Ok(())
    }

    /// Copies decrypted bytes into `dst`, first decrypting what the socket already
    /// gave if needed; `None` when the socket must be read first.
    fn decrypt_into(&mut self, dst: &mut [u8], peer: &str) -> Result<Option<usize>, NetError> {
        let mut conn = self.conn.lock().unwrap_or_else(|p| p.into_inner());
        loop {
            match conn.reader().read(dst) {
                // The peer sent close_notify.
                Ok(0) => return Err(NetError::Closed { peer: peer.to_string() }),
                Ok(n) => return Ok(Some(n)),
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => {}
                Err(_) => return Err(NetError::Closed { peer: peer.to_string() }),
            }
            if self.start == self.end {
                return Ok(None);
            }
            let mut pending = &self.incoming[self.start..self.end];
            let n = conn.read_tls(&mut pending).map_err(|e| NetError::Tls {
                peer: peer.to_string(),
                reason: e.to_string(),
            })?;
            if n == 0 {
                return Err(NetError::Tls {
                    peer: peer.to_string(),
                    reason: "rustls accepted no more ciphertext".into(),
                });
            }
            self.start += n;
            conn.process_new_packets().map_err(|e| tls_error(peer, &e))?;
        }
    }
}

/// The first `limit` bytes of `parts`.
fn prefix<'a>(parts: &'a [IoSlice<'_>], limit: usize) -> Vec<IoSlice<'a>> {
    let mut left = limit;
    let mut out = Vec::with_capacity(parts.len());
    for part in parts {
        let take = part.len().min(left);
        if take == 0 {
            break;
        }
        out.push(IoSlice::new(&part[..take]));
        left -= take;
    }
    out
}

fn write_error(peer: &str, e: io::Error) -> NetError {
    match e.get_ref().and_then(|inner| inner.downcast_ref::<rustls::Error>()) {
        Some(tls) => tls_error(peer, tls),
        None => NetError::Io {
            peer: peer.to_string(),
            source: e,
        },
    }
}

fn handshake_error(peer: &str, e: io::Error) -> NetError {
    if let Some(tls) = e.get_ref().and_then(|inner| inner.downcast_ref::<rustls::Error>()) {
        return tls_error(peer, tls);
    }
    match e.kind() {
        io::ErrorKind::UnexpectedEof | io::ErrorKind::ConnectionReset | io::ErrorKind::BrokenPipe => NetError::Tls {
            peer: peer.to_string(),
            reason: "the connection closed during the TLS handshake: the peer may run without TLS \
                     (no --tls-cert), and a baton node without TLS closes it this way"
                .into(),
        },
        _ => read_error(peer, e),
    }
}

/// Names what went wrong in the words of a cluster operator.
fn tls_error(peer: &str, e: &rustls::Error) -> NetError {
    let reason = match e {
        rustls::Error::InvalidCertificate(CertificateError::Other(other))
            if other.0.downcast_ref::<NotClusterCert>().is_some() =>
        {
            "it presented a certificate that is not this cluster's (--tls-cert): \
             the two nodes hold different cluster certificates"
                .to_string()
        }
        rustls::Error::AlertReceived(
            AlertDescription::BadCertificate
            | AlertDescription::CertificateUnknown
            | AlertDescription::UnknownCA
            | AlertDescription::UnsupportedCertificate,
        ) => "it refused this node's certificate: the two nodes hold different cluster certificates \
              (--tls-cert)"
            .to_string(),
        rustls::Error::AlertReceived(AlertDescription::CertificateRequired)
        | rustls::Error::NoCertificatesPresented => {
            "a certificate is required on both ends, and one end presented none".to_string()
        }
        other => other.to_string(),
    };
    NetError::Tls {
        peer: peer.to_string(),
        reason,
    }
}

/// Whether `head` (the first bytes a peer sent) opens a TLS handshake record: content
/// type 22, major version 3. A baton frame starts with its little-endian length, and
/// no first frame is that long.
pub(crate) fn looks_like_tls(head: &[u8]) -> bool {
    matches!(head, [0x16, 0x03, ..] | [0x16])
}

#[cfg(test)]
mod tests;
