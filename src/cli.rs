//! The operator's command line: `explain`, `leases`, `locks`, `blocked`, `revoke` and
//! `force-release`, each one call of `dispatch.v1.Admin` on a running broker, printed as a
//! table for people or as JSON (`--json`) for scripts. A gRPC client at the edge, like `worker`:
//! it decides nothing, and its errors say what to do.

use std::time::Duration;

use anyhow::Context;
use comfy_table::{presets, Table};
use serde_json::{json, Value};
use tonic::transport::{Channel, Endpoint};

use crate::config::{
    AdminClientArgs, BlockedArgs, ExplainArgs, FairnessArgs, ForceReleaseArgs, LeasesArgs,
    LocksArgs, RevokeArgs,
};
use crate::proto;
use crate::proto::admin_client::AdminClient;

type Client = AdminClient<tonic::service::interceptor::InterceptedService<Channel, TokenAuth>>;

type Header = tonic::metadata::MetadataValue<tonic::metadata::Ascii>;

/// Adds the admin token, and who runs the CLI (`user@host`, for the broker's audit), to every
/// call.
#[derive(Clone)]
struct TokenAuth {
    token: Option<Header>,
    actor: Option<Header>,
}

impl tonic::service::Interceptor for TokenAuth {
    fn call(
        &mut self,
        mut request: tonic::Request<()>,
    ) -> Result<tonic::Request<()>, tonic::Status> {
        if let Some(token) = &self.token {
            request
                .metadata_mut()
                .insert("authorization", token.clone());
        }
        if let Some(actor) = &self.actor {
            request
                .metadata_mut()
                .insert(crate::security::ACTOR_HEADER, actor.clone());
        }
        Ok(request)
    }
}

/// `user@host` of whoever runs the CLI, from the environment.
fn whoami() -> Option<Header> {
    let user = std::env::var("USER")
        .or_else(|_| std::env::var("LOGNAME"))
        .ok()?;
    let host = std::fs::read_to_string("/etc/hostname")
        .map(|h| h.trim().to_owned())
        .unwrap_or_default();
    let who = if host.is_empty() {
        user
    } else {
        format!("{user}@{host}")
    };
    who.parse().ok()
}

/// Connects to the broker `args` names, with its credential.
async fn connect(args: &AdminClientArgs) -> anyhow::Result<Client> {
    let token = match (&args.admin_token_file, &args.admin_token) {
        (Some(path), _) => Some(
            std::fs::read_to_string(path)
                .with_context(|| format!("cannot read --admin-token-file {}", path.display()))?,
        ),
        (None, Some(token)) => Some(token.clone()),
        (None, None) => None,
    };
    let header = token
        .map(|t| format!("Bearer {}", t.trim()).parse())
        .transpose()
        .map_err(|_| {
            anyhow::anyhow!("the admin token holds characters that cannot travel in a header")
        })?;
    let mut endpoint = Endpoint::from_shared(args.broker.addr.clone())
        .with_context(|| {
            format!(
                "--addr {:?} is not a URL like http://127.0.0.1:50051",
                args.broker.addr
            )
        })?
        .connect_timeout(args.timeout)
        .timeout(args.timeout);
    if let Some(tls) = crate::security::broker_tls(&args.broker)? {
        endpoint = endpoint.tls_config(tls)?;
    }
    let channel = endpoint.connect().await.map_err(|e| {
        anyhow::anyhow!(
            "cannot reach the broker at {} ({}); is it running? Point --addr or DISPATCH_ADDR at \
             its gRPC port",
            args.broker.addr,
            source_text(&e)
        )
    })?;
    Ok(AdminClient::with_interceptor(
        channel,
        TokenAuth {
            token: header,
            actor: whoami(),
        },
    ))
}

/// The innermost cause of a transport error (tonic's outer text is just "transport error").
fn source_text(e: &(dyn std::error::Error + 'static)) -> String {
    let mut inner: &dyn std::error::Error = e;
    while let Some(next) = inner.source() {
        inner = next;
    }
    inner.to_string()
}

/// Turns a refused call into a line that says what to do.
fn refused(status: tonic::Status) -> anyhow::Error {
    use tonic::Code;
    let hint = match status.code() {
        Code::Unauthenticated => {
            " (pass the broker's admin token: --admin-token-file or DISPATCH_ADMIN_TOKEN)"
        }
        Code::Unavailable => " (the broker or one of its stores is unreachable; retry shortly)",
        Code::Unimplemented => " (this broker is too old for the admin API)",
        _ => "",
    };
    anyhow::anyhow!(
        "the broker answered {:?}: {}{hint}",
        status.code(),
        status.message()
    )
}

fn print_json(value: &Value) {
    println!(
        "{}",
        serde_json::to_string_pretty(value).unwrap_or_else(|_| value.to_string())
    );
}

fn table(header: &[&str]) -> Table {
    let mut t = Table::new();
    t.load_preset(presets::NOTHING)
        .set_header(header.iter().copied());
    t
}

fn time(t: &Option<prost_types::Timestamp>) -> String {
    t.as_ref()
        .and_then(|t| chrono::DateTime::from_timestamp(t.seconds, t.nanos.max(0) as u32))
        .map(|t| t.to_rfc3339_opts(chrono::SecondsFormat::Secs, true))
        .unwrap_or_default()
}

fn span(d: &Option<prost_types::Duration>) -> String {
    d.as_ref()
        .and_then(|d| Duration::try_from(*d).ok())
        .map(|d| humantime::format_duration(Duration::from_secs(d.as_secs())).to_string())
        .unwrap_or_default()
}

fn short(id: &str) -> &str {
    id.get(..8).unwrap_or(id)
}

fn holder_json(h: &proto::LockHolder) -> Value {
    json!({
        "task_id": h.task_id,
        "lease_id": h.lease_id,
        "worker_name": h.worker_name,
        "fencing_token": h.fencing_token,
        "lease_expires_at": time(&h.lease_expires_at),
        "lease_alive": h.lease_alive,
    })
}

fn lock_json(l: &proto::ResourceLock) -> Value {
    json!({
        "resource": l.resource,
        "mode": l.mode,
        "holders": l.holders.iter().map(holder_json).collect::<Vec<_>>(),
    })
}

fn explanation_json(e: &proto::Explanation) -> Value {
    json!({
        "task_id": e.task_id,
        "name": e.name,
        "state": e.state,
        "created_at": time(&e.created_at),
        "exclusive_resources": e.exclusive_resources,
        "shared_resources": e.shared_resources,
        "versions": e.versions,
        "summary": e.summary,
        "ready": e.ready,
        "holder": e.holder.as_ref().map(holder_json),
        "older_conflicts": e.older_conflicts.iter().map(|o| json!({
            "task_id": o.task_id,
            "state": o.state,
            "name": o.name,
            "created_at": time(&o.created_at),
            "age": span(&o.age),
            "conflicts": o.conflicts.iter().map(|c| json!({
                "resource": c.resource, "wanted": c.wanted, "held": c.held,
            })).collect::<Vec<_>>(),
        })).collect::<Vec<_>>(),
        "older_conflicts_total": e.older_conflicts_total,
        "conflicting_locks": e.conflicting_locks.iter().map(lock_json).collect::<Vec<_>>(),
        "live_leases": e.live_leases,
        "incompatible_with_every_live_lease": e.incompatible_with_every_live_lease,
    })
}

fn holder_text(h: &proto::LockHolder) -> String {
    let worker = if h.worker_name.is_empty() {
        "(lease gone)"
    } else {
        &h.worker_name
    };
    let life = if h.lease_alive { "alive" } else { "EXPIRED" };
    format!(
        "task {} by {worker} (lease {}, token {}, {life})",
        short(&h.task_id),
        h.lease_id,
        h.fencing_token
    )
}

fn print_explanation(e: &proto::Explanation) {
    let mut resources: Vec<String> = e.exclusive_resources.clone();
    resources.extend(e.shared_resources.iter().map(|r| format!("shared:{r}")));
    println!("task      {}  {}", e.task_id, e.name);
    println!("state     {}  (created {})", e.state, time(&e.created_at));
    println!("resources {}", resources.join(", "));
    if !e.versions.is_empty() {
        let v: Vec<String> = e
            .versions
            .iter()
            .map(|(k, v)| format!("{k}>={v}"))
            .collect();
        println!("needs     {}", v.join(", "));
    }
    println!("=> {}", e.summary);
    if let Some(h) = &e.holder {
        println!("held by   {}", holder_text(h));
    }
    if !e.older_conflicts.is_empty() {
        println!(
            "\nolder conflicting tasks ({} of {}, oldest first):",
            e.older_conflicts.len(),
            e.older_conflicts_total
        );
        let mut t = table(&["TASK", "STATE", "NAME", "AGE", "CONFLICTS ON"]);
        for o in &e.older_conflicts {
            let on: Vec<String> = o
                .conflicts
                .iter()
                .map(|c| format!("{} ({} vs {})", c.resource, c.wanted, c.held))
                .collect();
            t.add_row(vec![
                o.task_id.clone(),
                o.state.clone(),
                o.name.clone(),
                span(&o.age),
                on.join(", "),
            ]);
        }
        println!("{t}");
    }
    if !e.conflicting_locks.is_empty() {
        println!("\nheld locks in the way:");
        let mut t = table(&["RESOURCE", "MODE", "HOLDER"]);
        for l in &e.conflicting_locks {
            for h in &l.holders {
                t.add_row(vec![l.resource.clone(), l.mode.clone(), holder_text(h)]);
            }
        }
        println!("{t}");
    }
    if e.state == "waiting" && e.holder.is_none() {
        println!(
            "\nlive leases: {}{}",
            e.live_leases,
            if e.incompatible_with_every_live_lease {
                " (none has the versions this task needs)"
            } else {
                ""
            }
        );
    }
}

/// `dispatch-broker explain TASK_ID`.
pub async fn explain(args: &ExplainArgs) -> anyhow::Result<()> {
    let mut client = connect(&args.client).await?;
    let e = client
        .explain_task(proto::ExplainTaskRequest {
            task_id: args.task_id.clone(),
            max_conflicts: args.max_conflicts,
        })
        .await
        .map_err(refused)?
        .into_inner();
    if args.client.json {
        print_json(&explanation_json(&e));
    } else {
        print_explanation(&e);
    }
    Ok(())
}

/// `dispatch-broker leases`.
pub async fn leases(args: &LeasesArgs) -> anyhow::Result<()> {
    let mut client = connect(&args.client).await?;
    let page = client
        .list_leases(proto::ListLeasesRequest {
            worker_contains: args.worker.clone(),
            include_expired: args.include_expired,
            page_size: args.page_size,
            page_token: args.page_token.clone(),
        })
        .await
        .map_err(refused)?
        .into_inner();
    if args.client.json {
        print_json(&json!({
            "leases": page.leases.iter().map(|l| json!({
                "lease_id": l.lease_id,
                "worker_name": l.worker_name,
                "versions": l.versions,
                "expires_at": time(&l.expires_at),
                "alive": l.alive,
                "app_status_id": l.app_status_id,
                "task_ids": l.task_ids,
                "locks": l.locks,
            })).collect::<Vec<_>>(),
            "next_page_token": page.next_page_token,
            "total": page.total,
        }));
        return Ok(());
    }
    let mut t = table(&["LEASE", "WORKER", "ALIVE", "EXPIRES", "TASKS", "LOCKS"]);
    for l in &page.leases {
        t.add_row(vec![
            l.lease_id.clone(),
            l.worker_name.clone(),
            if l.alive { "yes" } else { "EXPIRED" }.into(),
            time(&l.expires_at),
            l.task_ids
                .iter()
                .map(|t| short(t))
                .collect::<Vec<_>>()
                .join(" "),
            l.locks.join(" "),
        ]);
    }
    println!("{t}");
    footer(
        page.leases.len(),
        page.total,
        &page.next_page_token,
        "leases",
    );
    Ok(())
}

fn footer(shown: usize, total: u64, next: &str, what: &str) {
    if next.is_empty() {
        println!("{shown} shown, {total} {what} in all");
    } else {
        println!("{shown} shown, {total} {what} in all; next page: --page-token {next}");
    }
}

/// `dispatch-broker locks [PREFIX]`.
pub async fn locks(args: &LocksArgs) -> anyhow::Result<()> {
    let mut client = connect(&args.client).await?;
    let page = client
        .list_locks(proto::ListLocksRequest {
            resource_prefix: args.prefix.clone(),
            page_size: args.page_size,
            page_token: args.page_token.clone(),
        })
        .await
        .map_err(refused)?
        .into_inner();
    if args.client.json {
        print_json(&json!({
            "locks": page.locks.iter().map(lock_json).collect::<Vec<_>>(),
            "next_page_token": page.next_page_token,
            "total": page.total,
        }));
        return Ok(());
    }
    let mut t = table(&[
        "RESOURCE",
        "MODE",
        "TASK",
        "WORKER",
        "LEASE",
        "TOKEN",
        "LEASE STATE",
    ]);
    for l in &page.locks {
        for h in &l.holders {
            t.add_row(vec![
                l.resource.clone(),
                l.mode.clone(),
                h.task_id.clone(),
                h.worker_name.clone(),
                h.lease_id.clone(),
                h.fencing_token.to_string(),
                if h.lease_alive { "alive" } else { "EXPIRED" }.into(),
            ]);
        }
    }
    println!("{t}");
    footer(
        page.locks.len(),
        page.total,
        &page.next_page_token,
        "locked resources",
    );
    Ok(())
}

/// `dispatch-broker fairness`, `fairness set` and `fairness reset`.
pub async fn fairness(args: &FairnessArgs) -> anyhow::Result<()> {
    use crate::config::FairnessAction;
    let (request, client_args) = match &args.action {
        None => {
            let mut client = connect(&args.client).await?;
            let report = client
                .fairness(proto::FairnessRequest {})
                .await
                .map_err(refused)?
                .into_inner();
            print_fairness(&report, args.client.json);
            return Ok(());
        }
        Some(FairnessAction::Set(set)) => (
            proto::SetFairnessRequest {
                domain: set.domain.clone().unwrap_or_default(),
                weight: set.weight,
                cap: set.cap,
                no_cap: set.no_cap,
                reserve: set.reserve,
                reset: false,
                reason: set.reason.clone(),
            },
            &set.client,
        ),
        Some(FairnessAction::Reset(reset)) => (
            proto::SetFairnessRequest {
                reset: true,
                reason: reset.reason.clone(),
                ..Default::default()
            },
            &reset.client,
        ),
    };
    let mut client = connect(client_args).await?;
    let r = client
        .set_fairness(request)
        .await
        .map_err(refused)?
        .into_inner();
    if client_args.json {
        print_json(&json!({
            "audit": audit_json(&r.audit),
            "fairness": r.fairness.as_ref().map(fairness_json),
            "note": r.note,
        }));
    } else {
        print_audit(&r.audit);
        if let Some(report) = &r.fairness {
            print_fairness(report, false);
        }
        if !r.note.is_empty() {
            println!("note: {}", r.note);
        }
    }
    Ok(())
}

fn fairness_json(report: &proto::FairnessResponse) -> Value {
    json!({
        "fair_by": report.fair_by,
        "source": report.source,
        "reserve": report.reserve,
        "default_weight": report.default_weight,
        "live_leases": report.live_leases,
        "deferred_running": report.deferred_running,
        "directed": report.directed,
        "domains": report.domains.iter().map(|d| json!({
            "domain_id": d.domain_id,
            "name": d.name,
            "weight": d.weight,
            "cap": d.cap,
            "running": d.running,
            "waiting": d.waiting,
            "share": d.share,
        })).collect::<Vec<_>>(),
        "overrides": report.overrides,
    })
}

fn print_fairness(report: &proto::FairnessResponse, as_json: bool) {
    if as_json {
        print_json(&fairness_json(report));
        return;
    }
    let mut t = table(&[
        "DOMAIN", "ID", "WEIGHT", "CAP", "RUNNING", "WAITING", "SHARE",
    ]);
    for d in &report.domains {
        t.add_row(vec![
            if d.name.is_empty() {
                "-".to_owned()
            } else {
                d.name.clone()
            },
            d.domain_id.clone(),
            format!("{}", d.weight),
            d.cap.map_or_else(|| "-".to_owned(), |c| c.to_string()),
            d.running.to_string(),
            if d.waiting { "yes" } else { "no" }.to_owned(),
            format!("{:.0}%", d.share * 100.0),
        ]);
    }
    println!("{t}");
    println!(
        "fair dispatch by {}{}; policy from {}; reserve {} of {} live leases ({} deferred tasks hold locks)",
        report.fair_by,
        if report.directed || report.fair_by == "none" {
            ""
        } else {
            " (without its indexes: queue order; run `dispatch-broker migrate --fair-indexes`)"
        },
        if report.source == "file" { "the policy file (--fair-policy)" } else { "the defaults (no --fair-policy)" },
        report.reserve,
        report.live_leases,
        report.deferred_running,
    );
    if !report.overrides.is_empty() {
        println!(
            "overrides made at run time (not in the policy file): {}",
            report.overrides.join("; ")
        );
    }
}

/// `dispatch-broker blocked`.
pub async fn blocked(args: &BlockedArgs) -> anyhow::Result<()> {
    let mut client = connect(&args.client).await?;
    let report = client
        .blocked_resources(proto::BlockedResourcesRequest { limit: args.limit })
        .await
        .map_err(refused)?
        .into_inner();
    if args.client.json {
        print_json(&json!({
            "resources": report.resources.iter().map(|b| json!({
                "resource": b.resource,
                "waiting": b.waiting,
                "head": b.head.as_ref().map(explanation_json),
            })).collect::<Vec<_>>(),
            "computed_at": time(&report.computed_at),
            "age": span(&report.age),
            "source": report.source,
        }));
        return Ok(());
    }
    let mut t = table(&[
        "RESOURCE",
        "WAITING",
        "HEAD TASK",
        "HEAD STATE",
        "WHAT HOLDS UP THE HEAD",
    ]);
    for b in &report.resources {
        let (id, state, why) = match &b.head {
            Some(h) => (h.task_id.clone(), h.state.clone(), h.summary.clone()),
            None => ("(gone)".into(), String::new(), String::new()),
        };
        t.add_row(vec![
            b.resource.clone(),
            b.waiting.to_string(),
            id,
            state,
            why,
        ]);
    }
    println!("{t}");
    // (A broker from before `source` sends none: it counted with the lane gauge.)
    let gauge = matches!(report.source.as_str(), "lane_gauge" | "");
    let counted = if gauge {
        "counted by the lane gauge's last full pass"
    } else {
        "counted from this broker's resource queues"
    };
    println!(
        "{counted}, which read the task table {} ago{}; `dispatch-broker explain TASK` for the \
         whole story",
        span(&report.age),
        if gauge {
            " (tasks younger than its cut-off are not counted)"
        } else {
            ""
        }
    );
    Ok(())
}

fn print_audit(audit: &Option<proto::AuditRecord>) {
    if let Some(a) = audit {
        println!(
            "{} {} by {} at {}: {}\nreason: {}",
            a.action,
            a.target,
            a.actor,
            time(&a.at),
            a.outcome,
            a.reason
        );
    }
}

fn audit_json(a: &Option<proto::AuditRecord>) -> Value {
    a.as_ref()
        .map(|a| {
            json!({
                "action": a.action, "actor": a.actor, "target": a.target,
                "reason": a.reason, "at": time(&a.at), "outcome": a.outcome,
            })
        })
        .unwrap_or(Value::Null)
}

/// `dispatch-broker revoke LEASE_ID --reason ...`.
pub async fn revoke(args: &RevokeArgs) -> anyhow::Result<()> {
    let mut client = connect(&args.client).await?;
    let r = client
        .revoke_lease(proto::RevokeLeaseRequest {
            lease_id: args.lease_id.clone(),
            reason: args.reason.clone(),
        })
        .await
        .map_err(refused)?
        .into_inner();
    if args.client.json {
        print_json(&json!({
            "audit": audit_json(&r.audit),
            "released_locks": r.released_locks,
            "requeued_tasks": r.requeued_tasks,
            "failed_tasks": r.failed_tasks,
        }));
    } else {
        print_audit(&r.audit);
    }
    Ok(())
}

/// `dispatch-broker force-release RESOURCE --reason ...`.
pub async fn force_release(args: &ForceReleaseArgs) -> anyhow::Result<()> {
    let mut client = connect(&args.client).await?;
    let r = client
        .force_release(proto::ForceReleaseRequest {
            resource: args.resource.clone(),
            reason: args.reason.clone(),
        })
        .await
        .map_err(refused)?
        .into_inner();
    if args.client.json {
        print_json(&json!({
            "audit": audit_json(&r.audit),
            "released": r.released.iter().map(holder_json).collect::<Vec<_>>(),
            "released_locks": r.released_locks,
            "requeued_tasks": r.requeued_tasks,
            "failed_tasks": r.failed_tasks,
        }));
    } else {
        print_audit(&r.audit);
        for h in &r.released {
            println!("released: {}", holder_text(h));
        }
    }
    Ok(())
}
