//! Who may call the broker: the bearer-token check on worker RPCs, and TLS (optionally mutual)
//! on the gRPC port.

use std::path::Path;
use std::sync::Arc;

use anyhow::Context;
use subtle::ConstantTimeEq;
use tonic::transport::{Certificate, ClientTlsConfig, Identity, ServerTlsConfig};
use tonic::{Request, Status};

use crate::config::{BrokerAddrArgs, SecurityArgs};

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

    /// Reads the token from `--auth-token-file` or `--auth-token` (surrounding whitespace
    /// trimmed).
    pub fn from_args(args: &SecurityArgs) -> anyhow::Result<Self> {
        let token = read_token(
            args.auth_token_file.as_deref(),
            args.auth_token.as_deref(),
            "auth-token",
            "AUTH_TOKEN",
        )?;
        Ok(BearerAuth::new(token))
    }
}

/// Reads a token from its file option or its value option, checked for what cannot work.
fn read_token(
    file: Option<&Path>,
    value: Option<&str>,
    option: &str,
    env: &str,
) -> anyhow::Result<Option<String>> {
    let (token, source) = match (file, value) {
        (Some(path), _) => (
            std::fs::read_to_string(path)
                .with_context(|| format!("cannot read --{option}-file {}", path.display()))?,
            format!("--{option}-file {}", path.display()),
        ),
        (None, Some(token)) => (token.to_owned(), format!("--{option} (DISPATCH_{env})")),
        (None, None) => return Ok(None),
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
    Ok(Some(token.to_owned()))
}

/// The metadata key in which an admin client names the person or program behind the call.
pub const ACTOR_HEADER: &str = "x-dispatch-actor";

/// The name of whoever passed [`AdminAuth`], put in the request's extensions for the audit.
#[derive(Debug, Clone)]
pub struct Actor(pub String);

/// Guards the admin API: the admin token, or (with mutual TLS) a client certificate named in
/// --admin-client-name, opens it; a worker's token or another client certificate gets
/// PERMISSION_DENIED. With no authentication configured at all it is open (actor "anonymous");
/// with worker authentication but no admin credential it is off.
#[derive(Clone, Default)]
pub struct AdminAuth {
    admin: Option<Arc<[u8]>>,
    worker: Option<Arc<[u8]>>,
    /// Client-certificate names that are admins.
    names: Arc<[String]>,
    /// Any authentication is configured (a worker token or client certificates).
    guarded: bool,
}

impl AdminAuth {
    /// Reads `--admin-token-file`/`--admin-token` beside the worker token, and the admin
    /// certificate names.
    pub fn from_args(args: &SecurityArgs) -> anyhow::Result<Self> {
        let admin = read_token(
            args.admin_token_file.as_deref(),
            args.admin_token.as_deref(),
            "admin-token",
            "ADMIN_TOKEN",
        )?;
        let worker = read_token(
            args.auth_token_file.as_deref(),
            args.auth_token.as_deref(),
            "auth-token",
            "AUTH_TOKEN",
        )?;
        anyhow::ensure!(
            admin.is_none() || admin != worker,
            "the admin token equals the worker token; give the admin API its own token"
        );
        anyhow::ensure!(
            args.admin_client_names.is_empty() || args.tls_client_ca.is_some(),
            "--admin-client-name needs mutual TLS: set --tls-client-ca (and --tls-cert, --tls-key)"
        );
        Ok(AdminAuth {
            guarded: worker.is_some() || args.tls_client_ca.is_some(),
            admin: admin.map(|t| Arc::from(t.into_bytes())),
            worker: worker.map(|t| Arc::from(t.into_bytes())),
            names: args
                .admin_client_names
                .iter()
                .map(|n| n.trim().to_owned())
                .filter(|n| !n.is_empty())
                .collect(),
        })
    }

    /// Who the call's credential names, or why it is refused; `None`: no admin credential came.
    fn identify(&self, request: &Request<()>) -> Result<Option<String>, Status> {
        let given = request
            .metadata()
            .get("authorization")
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.strip_prefix("Bearer "))
            .map(str::as_bytes);
        let is = |token: &Option<Arc<[u8]>>, given: &[u8]| {
            token.as_ref().is_some_and(|t| bool::from(given.ct_eq(t)))
        };
        if let Some(given) = given {
            if is(&self.admin, given) {
                return Ok(Some("admin-token".into()));
            }
            if is(&self.worker, given) {
                return Err(Status::permission_denied(
                    "this is a worker's token; the admin API needs the admin token (the \
                     broker's --admin-token-file; the CLI reads DISPATCH_ADMIN_TOKEN)",
                ));
            }
        }
        if self.names.is_empty() {
            return Ok(None);
        }
        let Some(certs) = request.peer_certs() else {
            return Ok(None);
        };
        let names = certs.first().map(|c| cert_names(c)).unwrap_or_default();
        match names.iter().find(|n| self.names.contains(n)) {
            Some(name) => Ok(Some(format!("cert:{name}"))),
            None => Err(Status::permission_denied(format!(
                "the client certificate ({}) is not an admin's; the broker's \
                 --admin-client-name lists the admin certificates",
                names.join(", ")
            ))),
        }
    }
}

/// The names a certificate carries: subject common names and DNS subject alternative names.
fn cert_names(der: &[u8]) -> Vec<String> {
    let Ok((_, cert)) = x509_parser::parse_x509_certificate(der) else {
        return Vec::new();
    };
    let mut names: Vec<String> = cert
        .subject()
        .iter_common_name()
        .filter_map(|cn| cn.as_str().ok().map(str::to_owned))
        .collect();
    if let Ok(Some(san)) = cert.subject_alternative_name() {
        for name in &san.value.general_names {
            if let x509_parser::extensions::GeneralName::DNSName(dns) = name {
                names.push((*dns).to_owned());
            }
        }
    }
    names
}

impl tonic::service::Interceptor for AdminAuth {
    fn call(&mut self, mut request: Request<()>) -> Result<Request<()>, Status> {
        let actor = match self.identify(&request)? {
            Some(actor) => actor,
            None => {
                let configured = self.admin.is_some() || !self.names.is_empty();
                if configured {
                    return Err(Status::unauthenticated(
                        "missing or wrong admin credential: send `authorization: Bearer <token>` \
                         with the broker's --admin-token-file token (the CLI reads \
                         DISPATCH_ADMIN_TOKEN or --admin-token-file), or an admin client \
                         certificate",
                    ));
                }
                if self.guarded {
                    return Err(Status::permission_denied(
                        "the admin API is off on this broker: start it with --admin-token-file \
                         (or DISPATCH_ADMIN_TOKEN) and call with that token",
                    ));
                }
                "anonymous".to_owned()
            }
        };
        // Who is behind the credential, as the client says (the CLI sends `user@host`): for the
        // audit only, never for a decision.
        let said = request
            .metadata()
            .get(ACTOR_HEADER)
            .and_then(|v| v.to_str().ok())
            .map(|v| v.chars().take(128).collect::<String>())
            .filter(|v| !v.is_empty() && v.chars().all(|c| c.is_ascii_graphic()));
        let actor = match said {
            Some(said) => format!("{actor} ({said})"),
            None => actor,
        };
        request.extensions_mut().insert(Actor(actor));
        Ok(request)
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

/// The TLS settings `health` and the admin commands connect with, when `--tls-ca` is given.
pub fn broker_tls(args: &BrokerAddrArgs) -> anyhow::Result<Option<ClientTlsConfig>> {
    // clap checks this for options and variables; an old variable name stands in as a default,
    // which clap's `requires` does not see.
    anyhow::ensure!(
        args.tls_cert.is_some() == args.tls_key.is_some(),
        "--tls-cert and --tls-key (DISPATCH_CLIENT_TLS_CERT, DISPATCH_CLIENT_TLS_KEY) go together"
    );
    client_tls(
        args.tls_ca.as_deref(),
        &args.tls_domain,
        args.tls_cert.as_deref().zip(args.tls_key.as_deref()),
    )
}

/// A client's TLS settings (the health probe, the admin CLI): `None` without a CA; with `ca`,
/// the broker's certificate is checked against it and `domain`, and `identity` (certificate,
/// key) is presented for mutual TLS.
pub fn client_tls(
    ca: Option<&Path>,
    domain: &str,
    identity: Option<(&Path, &Path)>,
) -> anyhow::Result<Option<ClientTlsConfig>> {
    let Some(ca) = ca else {
        return Ok(None);
    };
    let mut tls = ClientTlsConfig::new()
        .ca_certificate(Certificate::from_pem(read(ca, "--tls-ca")?))
        .domain_name(domain.to_owned());
    if let Some((cert, key)) = identity {
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
