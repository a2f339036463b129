//! rustls errors in words a person can act on.
//!
//! rustls prints some certificate errors as their Debug form (a pin
//! mismatch would read `Other(OtherError(PinMismatch { … }))`); clients
//! use [`explain`] instead, and [`find`] to dig the rustls error out of an
//! HTTP library's error chain.

use rustls::{CertificateError, InvalidMessage};

/// One line saying what failed and, where it helps, what to do.
pub fn explain(e: &rustls::Error) -> String {
    match e {
        rustls::Error::InvalidCertificate(CertificateError::Other(other)) => {
            format!("invalid peer certificate: {other}")
        }
        rustls::Error::InvalidCertificate(CertificateError::UnknownIssuer) => {
            "invalid peer certificate: not signed by a trusted authority (pass --ca-cert FILE, or pin it with --tls-fingerprint sha256:…)".to_string()
        }
        rustls::Error::InvalidMessage(InvalidMessage::InvalidContentType)
        | rustls::Error::InvalidMessage(InvalidMessage::UnknownProtocolVersion)
        | rustls::Error::InvalidMessage(InvalidMessage::MessageTooLarge) => {
            format!("{e} (the server does not speak TLS here: is its URL http://?)")
        }
        other => other.to_string(),
    }
}

/// The rustls error in `e`'s chain of sources, if any, including one
/// wrapped in `std::io::Error`s (hyper-rustls wraps tokio-rustls's wrapper
/// again), whose `source` skips what they wrap.
pub fn find<'a>(e: &'a (dyn std::error::Error + 'static)) -> Option<&'a rustls::Error> {
    let mut next = Some(e);
    while let Some(err) = next {
        if let Some(r) = err.downcast_ref::<rustls::Error>() {
            return Some(r);
        }
        if let Some(inner) = err
            .downcast_ref::<std::io::Error>()
            .and_then(|io| io.get_ref())
        {
            next = Some(inner as &(dyn std::error::Error + 'static));
            continue;
        }
        next = err.source();
    }
    None
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use rustls::OtherError;

    use super::*;
    use crate::{Fingerprint, PinMismatch};

    #[test]
    fn pin_mismatches_read_as_sentences_wherever_they_are_wrapped() {
        let a: Fingerprint = format!("sha256:{}", "a".repeat(64)).parse().unwrap();
        let b: Fingerprint = format!("sha256:{}", "b".repeat(64)).parse().unwrap();
        let e = rustls::Error::InvalidCertificate(CertificateError::Other(OtherError(Arc::new(
            PinMismatch {
                presented: a,
                pinned: b,
            },
        ))));
        let want = format!(
            "invalid peer certificate: the server's certificate has fingerprint {a}, not the pinned {b}"
        );
        assert_eq!(explain(&e), want);
        let io = std::io::Error::new(std::io::ErrorKind::InvalidData, e);
        assert_eq!(explain(find(&io).unwrap()), want);
        let twice = std::io::Error::other(io);
        assert_eq!(explain(find(&twice).unwrap()), want);
        let plain = std::io::Error::other("connection reset");
        assert!(find(&plain).is_none());
        let e = rustls::Error::InvalidMessage(InvalidMessage::InvalidContentType);
        assert!(
            explain(&e).contains("is its URL http://?"),
            "{}",
            explain(&e)
        );
    }
}
