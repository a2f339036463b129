//! What every client command is handed: the API client and how to print.

use crate::client::Client;

/// Everything a client command needs.
pub struct Ctx {
    /// The API.
    pub client: Client,
    /// Print raw JSON instead of tables.
    pub json: bool,
    /// How `https://` servers are trusted (the gateway too, for `demo`).
    pub trust: flotilla_client::Trust,
}
