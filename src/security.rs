//! Who may call the broker: the bearer-token check on worker RPCs, and TLS (optionally mutual)
//! on the gRPC port.

use std::path::Path;
use std::sync::Arc;

use anyhow::Context;
use subtle::ConstantTimeEq;
use tonic::transport::{Certificate, ClientTlsConfig, Identity, ServerTlsConfig};
use tonic::{Request, Status};

use crate::config::{HealthArgs, SecurityArgs};

/// Checks `authorization: Bearer <token>` on every call of the service it wraps; lets every call
/// through when no token is configured. Runs before the handler, so a rejected call does nothing.
#[derive(Clone, Default)]
pub struct BearerAuth {
    token: Option<Arc<[u8]>>,
}

impl BearerAuth {
    /// Requires `token` (none: no check).
    pub fn new(token: Option<String>) -> Self {
        BearerAuth {
            token: token.map(|t| Arc::from(t.into_bytes())),
        }
    }

    /// Reads the token from `--auth-token-file` (surrounding whitespace trimmed).
    pub fn from_args(args: &SecurityArgs) -> anyhow::Result<Self> {
        let (token, source) = match (&args.auth_token_file, &args.auth_token) {
            (Some(path), _) => (
                std::fs::read_to_string(path)
                    .with_context(|| format!("cannot read --auth-token-file {}", path.display()))?,
                format!("--auth-token-file {}", path.display()),
            ),
            (None, Some(token)) => (token.clone(), "--auth-token (DISPATCH_AUTH_TOKEN)".into()),
            (None, None) => return Ok(BearerAuth::default()),
        };
        let token = token.trim();
        anyhow::ensure!(!token.is_empty(), "{source} is empty");
        anyhow::ensure!(
            !token.starts_with("CHANGE-ME"),
            "{source} still holds the example token; use a long random one \
             (e.g. `openssl rand -hex 32`)"
        );
        anyhow::ensure!(
            token.bytes().all(|b| b.is_ascii_graphic()),
            "{source} holds characters that cannot travel in a header"
        );
        Ok(BearerAuth::new(Some(token.to_owned())))
    }
}

impl tonic::service::Interceptor for BearerAuth {
    fn call(&mut self, request: Request<()>) -> Result<Request<()>, Status> {
        let Some(expected) = &self.token else {
            return Ok(request);
        };
        let given = request
            .metadata()
            .get("authorization")
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.strip_prefix("Bearer "))
            .map(str::as_bytes)
            .unwrap_or_default();
        if given.ct_eq(expected).into() {
            Ok(request)
        } else {
            Err(Status::unauthenticated(
                "missing or wrong bearer token: send `authorization: Bearer <token>` with the \
                 token of the broker's --auth-token-file",
            ))
        }
    }
}

/// The server's TLS settings, when `--tls-cert` is given.
pub fn server_tls(args: &SecurityArgs) -> anyhow::Result<Option<ServerTlsConfig>> {
    let (Some(cert), Some(key)) = (&args.tls_cert, &args.tls_key) else {
        return Ok(None);
    };
    let mut tls = ServerTlsConfig::new().identity(Identity::from_pem(
        read(cert, "--tls-cert")?,
        read(key, "--tls-key")?,
    ));
    if let Some(ca) = &args.tls_client_ca {
        tls = tls.client_ca_root(Certificate::from_pem(read(ca, "--tls-client-ca")?));
    }
    Ok(Some(tls))
}

/// The health probe's TLS settings, when `--tls-ca` is given.
pub fn health_tls(args: &HealthArgs) -> anyhow::Result<Option<ClientTlsConfig>> {
    let Some(ca) = &args.tls_ca else {
        return Ok(None);
    };
    let mut tls = ClientTlsConfig::new()
        .ca_certificate(Certificate::from_pem(read(ca, "--tls-ca")?))
        .domain_name(args.tls_domain.clone());
    if let (Some(cert), Some(key)) = (&args.tls_cert, &args.tls_key) {
        tls = tls.identity(Identity::from_pem(
            read(cert, "--tls-cert")?,
            read(key, "--tls-key")?,
        ));
    }
    Ok(Some(tls))
}

/// Reads the file an option names, saying which option when it cannot.
fn read(path: &Path, option: &str) -> anyhow::Result<Vec<u8>> {
    std::fs::read(path).with_context(|| format!("cannot read {option} {}", path.display()))
}
