//! Why the container runtime failed: its own module so that the image
//! cache and the runtime's error type can name it without importing the
//! container runtime, which imports both.

/// Why the container runtime failed.
#[derive(Debug, thiserror::Error)]
pub enum ContainerError {
    /// The host firewall could not take a tenant's network in.
    #[error("cannot hold the tenant's network to the egress policy: {0}")]
    Firewall(String),
    /// The engine's address is not one this runtime speaks.
    #[error("unsupported docker host `{0}`: expected unix:///path/to/socket")]
    UnsupportedHost(String),
    /// The engine does not answer.
    #[error("container engine at `{host}` does not answer: {source}")]
    Unreachable {
        /// Its address.
        host: String,
        /// The cause.
        #[source]
        source: bollard::errors::Error,
    },
    /// The image could not be pulled.
    #[error("cannot pull image `{image}`: {source}")]
    Pull {
        /// The image.
        image: String,
        /// The cause.
        #[source]
        source: bollard::errors::Error,
    },
    /// An engine call failed.
    #[error("container engine: {what}: {source}")]
    Engine {
        /// What was being done.
        what: &'static str,
        /// The cause.
        #[source]
        source: bollard::errors::Error,
    },
    /// An engine call did not answer in time.
    #[error("container engine: {0}: no answer within 60 s")]
    Timeout(&'static str),
    /// The tenant's uid could not be claimed.
    #[error("cannot claim the tenant's user: {0}")]
    User(#[source] std::io::Error),
    /// A container carries Flotilla's labels but not valid ones.
    #[error("container `{id}` has an invalid label {label}")]
    BadLabel {
        /// The container.
        id: String,
        /// The label.
        label: &'static str,
    },
}
