//! Certificate fingerprints: the SHA-256 of a certificate's DER encoding,
//! the value a client pins to trust exactly one server certificate.
//!
//! Written `sha256:` and 64 lowercase hex digits. Parsing also takes the
//! colon-separated uppercase form `openssl x509 -fingerprint -sha256`
//! prints, with or without its `sha256 Fingerprint=` label, so an operator
//! can paste either.

use std::fmt;
use std::str::FromStr;

use rustls::pki_types::CertificateDer;
use sha2::{Digest, Sha256};

use crate::TlsError;

/// The SHA-256 fingerprint of a certificate.
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
pub struct Fingerprint([u8; 32]);

impl Fingerprint {
    /// The fingerprint of a DER-encoded certificate.
    pub fn of(cert: &CertificateDer<'_>) -> Self {
        Self(Sha256::digest(cert.as_ref()).into())
    }

    /// The 32 bytes of the digest.
    pub fn as_bytes(&self) -> &[u8; 32] {
        &self.0
    }
}

impl fmt::Display for Fingerprint {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "sha256:{}", hex::encode(self.0))
    }
}

impl fmt::Debug for Fingerprint {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Display::fmt(self, f)
    }
}

impl FromStr for Fingerprint {
    type Err = TlsError;

    fn from_str(input: &str) -> Result<Self, TlsError> {
        let err = |message: &str| TlsError::Fingerprint {
            input: input.to_string(),
            message: message.to_string(),
        };
        let s = input.trim();
        // `openssl x509 -fingerprint -sha256` prints
        // `sha256 Fingerprint=AB:CD:…` (`SHA256 Fingerprint=` in older
        // versions).
        let s = match s.split_once('=') {
            Some((label, rest)) if label.to_ascii_lowercase().contains("fingerprint") => rest,
            _ => s,
        };
        let digits = match s.split_once(':') {
            Some((algo, rest)) if algo.eq_ignore_ascii_case("sha256") => rest,
            Some((algo, _)) if algo.len() > 2 => {
                return Err(err("only sha256 fingerprints are supported"))
            }
            _ => s,
        };
        let digits: String = digits.chars().filter(|c| *c != ':').collect();
        if digits.len() != 64 {
            return Err(err(&format!(
                "expected sha256: and 64 hex digits, got {} digits",
                digits.len()
            )));
        }
        let mut out = [0u8; 32];
        hex::decode_to_slice(&digits, &mut out).map_err(|_| err("not hexadecimal"))?;
        Ok(Self(out))
    }
}

/// A server presented a certificate other than the pinned one: the error
/// a pinned client's handshake fails with, naming both fingerprints.
#[derive(Debug, Clone, thiserror::Error)]
#[error("the server's certificate has fingerprint {presented}, not the pinned {pinned}")]
pub struct PinMismatch {
    /// What the server presented.
    pub presented: Fingerprint,
    /// What the client pinned.
    pub pinned: Fingerprint,
}

#[cfg(test)]
mod tests {
    use super::*;

    const HEX: &str = "0f1e2d3c4b5a69788796a5b4c3d2e1f00112233445566778899aabbccddeeff0";

    #[test]
    fn fingerprints_print_and_parse_in_every_common_form() {
        let f: Fingerprint = format!("sha256:{HEX}").parse().unwrap();
        assert_eq!(f.to_string(), format!("sha256:{HEX}"));
        let colons: Vec<String> = HEX
            .as_bytes()
            .chunks(2)
            .map(|c| String::from_utf8_lossy(c).to_uppercase())
            .collect();
        let openssl = format!("sha256 Fingerprint={}", colons.join(":"));
        assert_eq!(openssl.parse::<Fingerprint>().unwrap(), f);
        assert_eq!(colons.join(":").parse::<Fingerprint>().unwrap(), f);
        assert_eq!(HEX.to_uppercase().parse::<Fingerprint>().unwrap(), f);
        assert_eq!(
            format!("SHA256:{}", colons.join(":"))
                .parse::<Fingerprint>()
                .unwrap(),
            f
        );
    }

    #[test]
    fn bad_fingerprints_say_what_is_wrong() {
        let e = "sha256:abcd"
            .parse::<Fingerprint>()
            .unwrap_err()
            .to_string();
        assert_eq!(
            e,
            "invalid TLS fingerprint `sha256:abcd`: expected sha256: and 64 hex digits, got 4 digits"
        );
        let e = format!("sha1:{HEX}").parse::<Fingerprint>().unwrap_err();
        assert!(e.to_string().contains("only sha256"), "{e}");
        let bad = format!("sha256:{}", "zz".repeat(32));
        let e = bad.parse::<Fingerprint>().unwrap_err();
        assert!(e.to_string().ends_with("not hexadecimal"), "{e}");
        assert!("".parse::<Fingerprint>().is_err());
    }

    #[test]
    fn the_fingerprint_is_the_sha256_of_the_der() {
        let der = CertificateDer::from(b"not really a certificate".to_vec());
        let f = Fingerprint::of(&der);
        assert_eq!(
            hex::encode(f.as_bytes()),
            hex::encode(Sha256::digest(b"not really a certificate"))
        );
    }
}
