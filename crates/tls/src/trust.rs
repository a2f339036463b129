//! How a client decides to believe a server: the client side of TLS.

use std::path::Path;
use std::sync::Arc;

use rustls::client::danger::{HandshakeSignatureValid, ServerCertVerified, ServerCertVerifier};
use rustls::crypto::{verify_tls12_signature, verify_tls13_signature, WebPkiSupportedAlgorithms};
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, ServerName, UnixTime};
use rustls::{CertificateError, DigitallySignedStruct, OtherError, RootCertStore, SignatureScheme};

use crate::{provider, Fingerprint, PinMismatch, TlsError};

/// Which server certificates a client accepts on `https://` URLs.
#[derive(Debug, Clone, Default)]
pub enum Trust {
    /// Certificates that chain to the operating system's root store and
    /// name the host (ordinary web PKI). The default.
    #[default]
    System,
    /// Certificates that chain to one of these CA certificates (read from
    /// a PEM file by [`Trust::ca_file`]) and name the host: a private CA,
    /// or a self-signed certificate used as its own CA.
    Roots(Arc<Vec<CertificateDer<'static>>>),
    /// Exactly the leaf certificate with this fingerprint, whatever names
    /// and dates it carries (a self-signed server certificate). The server
    /// must still prove it holds the certificate's key.
    Pinned(Fingerprint),
}

impl Trust {
    /// Trusts the CA certificates of the PEM file at `path` (one or more).
    pub fn ca_file(path: &Path) -> Result<Self, TlsError> {
        let what = "CA certificate";
        let pem = std::fs::read(path).map_err(|source| TlsError::Read {
            what,
            path: path.to_path_buf(),
            source,
        })?;
        let certs = CertificateDer::pem_slice_iter(&pem)
            .collect::<Result<Vec<_>, _>>()
            .map_err(|e| TlsError::Invalid {
                what,
                path: path.to_path_buf(),
                message: e.to_string(),
            })?;
        if certs.is_empty() {
            return Err(TlsError::Invalid {
                what,
                path: path.to_path_buf(),
                message: "no PEM certificate in it".to_string(),
            });
        }
        // Each must be usable as a trust anchor: fail here, naming the
        // file, rather than at the first request.
        let mut store = RootCertStore::empty();
        for cert in &certs {
            store.add(cert.clone()).map_err(|e| TlsError::Invalid {
                what,
                path: path.to_path_buf(),
                message: e.to_string(),
            })?;
        }
        Ok(Self::Roots(Arc::new(certs)))
    }

    /// The rustls client configuration that applies this trust (TLS 1.2
    /// and 1.3, HTTP/1.1 over it).
    pub fn client_config(&self) -> Result<rustls::ClientConfig, TlsError> {
        let provider = provider();
        let builder = rustls::ClientConfig::builder_with_provider(provider.clone())
            .with_safe_default_protocol_versions()?;
        let mut config = match self {
            Self::System => {
                let loaded = rustls_native_certs::load_native_certs();
                let mut store = RootCertStore::empty();
                // System stores often hold a few certificates webpki cannot
                // parse; skip those, as browsers do.
                let (added, _ignored) = store.add_parsable_certificates(loaded.certs);
                if added == 0 {
                    return Err(TlsError::NoSystemRoots);
                }
                builder.with_root_certificates(store).with_no_client_auth()
            }
            Self::Roots(certs) => {
                let mut store = RootCertStore::empty();
                for cert in certs.iter() {
                    store.add(cert.clone())?;
                }
                builder.with_root_certificates(store).with_no_client_auth()
            }
            Self::Pinned(pin) => builder
                .dangerous()
                .with_custom_certificate_verifier(Arc::new(PinnedVerifier::new(*pin)))
                .with_no_client_auth(),
        };
        config.alpn_protocols = vec![b"http/1.1".to_vec()];
        Ok(config)
    }
}

/// Accepts exactly the leaf certificate whose SHA-256 is pinned, and then
/// verifies the handshake signature with that certificate's key as usual,
/// so a server that copied the public certificate without its key fails.
///
/// Names and validity dates are not checked: the pin is the identity (the
/// SSH model), which is what makes a self-signed certificate usable from
/// any address. Replacing the certificate means pinning the new one.
#[derive(Debug)]
pub struct PinnedVerifier {
    pin: Fingerprint,
    algorithms: WebPkiSupportedAlgorithms,
}

impl PinnedVerifier {
    /// A verifier that accepts only the certificate with fingerprint `pin`.
    pub fn new(pin: Fingerprint) -> Self {
        Self {
            pin,
            algorithms: provider().signature_verification_algorithms,
        }
    }
}

impl ServerCertVerifier for PinnedVerifier {
    fn verify_server_cert(
        &self,
        end_entity: &CertificateDer<'_>,
        _intermediates: &[CertificateDer<'_>],
        _server_name: &ServerName<'_>,
        _ocsp_response: &[u8],
        _now: UnixTime,
    ) -> Result<ServerCertVerified, rustls::Error> {
        let presented = Fingerprint::of(end_entity);
        if presented == self.pin {
            return Ok(ServerCertVerified::assertion());
        }
        Err(rustls::Error::InvalidCertificate(CertificateError::Other(
            OtherError(Arc::new(PinMismatch {
                presented,
                pinned: self.pin,
            })),
        )))
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
