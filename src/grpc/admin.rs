//! `dispatch.v1.Admin`: the operator's API as a tonic adapter over `admin`. Checks every field
//! before anything is read or changed; errors map through the one `From<Error> for Status`.

use tonic::{Request, Response, Status};
use tracing::Instrument;

use super::convert::{parse_id, to_timestamp};
use crate::admin::{self, Admin};
use crate::config::LimitArgs;
use crate::ids::{LeaseId, TaskId};
use crate::proto;
use crate::security::Actor;

/// The longest resource name or prefix accepted (Pulp's are well under 200 bytes).
const MAX_RESOURCE_BYTES: usize = 4096;

/// Implements `dispatch.v1.Admin`.
#[derive(Clone)]
pub struct AdminService {
    admin: Admin,
    limits: LimitArgs,
}

impl AdminService {
    /// Wraps the operator's view.
    pub fn new(admin: Admin, limits: LimitArgs) -> Self {
        AdminService { admin, limits }
    }
}

/// A count with a default for 0 and a ceiling.
fn bounded(field: &str, value: u32, default: usize, max: usize) -> Result<usize, Status> {
    match value as usize {
        0 => Ok(default),
        n if n > max => Err(Status::invalid_argument(format!(
            "{field} is {n}; at most {max} are accepted (page through the rest)"
        ))),
        n => Ok(n),
    }
}

/// A required reason for an audited action.
fn reason(value: &str, limits: &LimitArgs) -> Result<String, Status> {
    let value = value.trim();
    if value.is_empty() {
        return Err(Status::invalid_argument(
            "reason is required: say why (it is logged, counted, and stored as the failure \
             reason of the tasks that were running)",
        ));
    }
    if value.len() > limits.error_bytes {
        return Err(Status::invalid_argument(format!(
            "reason is {} bytes; at most {} are accepted (--max-error-bytes)",
            value.len(),
            limits.error_bytes
        )));
    }
    Ok(value.to_owned())
}

/// A resource name (or prefix): bounded, without control characters; `required` refuses empty.
fn resource(field: &str, value: &str, required: bool) -> Result<String, Status> {
    if required && value.is_empty() {
        return Err(Status::invalid_argument(format!(
            "{field} is required: the resource name as in reserved_resources_record, without \
             `shared:` (`dispatch-broker locks` lists the held ones)"
        )));
    }
    if value.len() > MAX_RESOURCE_BYTES {
        return Err(Status::invalid_argument(format!(
            "{field} is {} bytes; at most {MAX_RESOURCE_BYTES} are accepted",
            value.len()
        )));
    }
    if value.chars().any(char::is_control) {
        return Err(Status::invalid_argument(format!(
            "{field} contains control characters"
        )));
    }
    Ok(value
        .strip_prefix(crate::ready::SHARED_PREFIX)
        .unwrap_or(value)
        .to_owned())
}

fn actor<T>(request: &Request<T>) -> String {
    request
        .extensions()
        .get::<Actor>()
        .map(|a| a.0.clone())
        .unwrap_or_else(|| "anonymous".into())
}

fn span(method: &'static str, actor: &str) -> tracing::Span {
    tracing::info_span!("admin", method, actor)
}

fn duration(d: std::time::Duration) -> Option<prost_types::Duration> {
    prost_types::Duration::try_from(d).ok()
}

impl From<admin::Holder> for proto::LockHolder {
    fn from(h: admin::Holder) -> Self {
        proto::LockHolder {
            task_id: h.task_id,
            lease_id: h.lease_id,
            worker_name: h.worker.unwrap_or_default(),
            fencing_token: h.fencing_token.0,
            lease_expires_at: h.lease_expires_at.map(to_timestamp),
            lease_alive: h.lease_alive,
        }
    }
}

impl From<admin::ResourceLock> for proto::ResourceLock {
    fn from(l: admin::ResourceLock) -> Self {
        proto::ResourceLock {
            resource: l.resource,
            mode: l.mode.as_str().to_owned(),
            holders: l.holders.into_iter().map(Into::into).collect(),
        }
    }
}

impl From<admin::Explanation> for proto::Explanation {
    fn from(e: admin::Explanation) -> Self {
        let now = chrono::Utc::now();
        proto::Explanation {
            task_id: e.task_id.to_string(),
            name: e.name,
            state: e.state.to_string(),
            created_at: Some(to_timestamp(e.created)),
            exclusive_resources: e.resources.exclusive,
            shared_resources: e.resources.shared,
            versions: e.versions.unwrap_or_default().into_iter().collect(),
            summary: e.summary,
            ready: e.ready,
            holder: e.holder.map(Into::into),
            older_conflicts: e
                .older
                .into_iter()
                .map(|o| proto::OlderTask {
                    task_id: o.id.to_string(),
                    state: o.state.to_string(),
                    name: o.name,
                    created_at: Some(to_timestamp(o.created)),
                    age: duration((now - o.created).to_std().unwrap_or_default()),
                    conflicts: o
                        .conflicts
                        .into_iter()
                        .map(|(resource, wanted, held)| proto::ResourceConflict {
                            resource,
                            wanted: wanted.as_str().to_owned(),
                            held: held.as_str().to_owned(),
                        })
                        .collect(),
                })
                .collect(),
            older_conflicts_total: e.older_total,
            conflicting_locks: e.conflicting_locks.into_iter().map(Into::into).collect(),
            live_leases: e.live_leases,
            incompatible_with_every_live_lease: e.incompatible_with_every_live_lease,
        }
    }
}

impl From<admin::AuditRecord> for proto::AuditRecord {
    fn from(a: admin::AuditRecord) -> Self {
        proto::AuditRecord {
            action: a.action.to_owned(),
            actor: a.actor,
            target: a.target,
            reason: a.reason,
            at: Some(to_timestamp(a.at)),
            outcome: a.outcome,
        }
    }
}

#[tonic::async_trait]
impl proto::admin_server::Admin for AdminService {
    async fn explain_task(
        &self,
        request: Request<proto::ExplainTaskRequest>,
    ) -> Result<Response<proto::Explanation>, Status> {
        let actor = actor(&request);
        let r = request.get_ref();
        let task_id = TaskId(parse_id("task_id", &r.task_id)?);
        let max = bounded("max_conflicts", r.max_conflicts, 10, 100)?;
        let explanation = self
            .admin
            .explain(task_id, max)
            .instrument(span("ExplainTask", &actor))
            .await?;
        Ok(Response::new(explanation.into()))
    }

    async fn list_leases(
        &self,
        request: Request<proto::ListLeasesRequest>,
    ) -> Result<Response<proto::ListLeasesResponse>, Status> {
        let actor = actor(&request);
        let r = request.into_inner();
        let page_size = bounded("page_size", r.page_size, 50, 500)?;
        if !r.page_token.is_empty() {
            parse_id("page_token", &r.page_token)?;
        }
        if r.worker_contains.len() > self.limits.name_bytes {
            return Err(Status::invalid_argument(format!(
                "worker_contains is {} bytes; at most {} are accepted (--max-name-bytes)",
                r.worker_contains.len(),
                self.limits.name_bytes
            )));
        }
        let page = self
            .admin
            .leases(
                &r.worker_contains,
                r.include_expired,
                page_size,
                &r.page_token,
            )
            .instrument(span("ListLeases", &actor))
            .await?;
        Ok(Response::new(proto::ListLeasesResponse {
            leases: page
                .items
                .into_iter()
                .map(|l| proto::LeaseInfo {
                    lease_id: l.lease.lease_id,
                    worker_name: l.lease.worker,
                    versions: l.versions.into_iter().collect(),
                    expires_at: Some(to_timestamp(crate::leases::from_ms(l.lease.expires_ms))),
                    alive: l.alive,
                    app_status_id: l.lease.app_status_id,
                    task_ids: l.lease.task_ids,
                    locks: l.lease.locks,
                })
                .collect(),
            next_page_token: page.next.unwrap_or_default(),
            total: page.total,
        }))
    }

    async fn list_locks(
        &self,
        request: Request<proto::ListLocksRequest>,
    ) -> Result<Response<proto::ListLocksResponse>, Status> {
        let actor = actor(&request);
        let r = request.into_inner();
        let page_size = bounded("page_size", r.page_size, 50, 500)?;
        let prefix = resource("resource_prefix", &r.resource_prefix, false)?;
        let after = (!r.page_token.is_empty()).then_some(r.page_token.as_str());
        let page = self
            .admin
            .locks(&prefix, page_size, after)
            .instrument(span("ListLocks", &actor))
            .await?;
        Ok(Response::new(proto::ListLocksResponse {
            locks: page.items.into_iter().map(Into::into).collect(),
            next_page_token: page.next.unwrap_or_default(),
            total: page.total,
        }))
    }

    async fn blocked_resources(
        &self,
        request: Request<proto::BlockedResourcesRequest>,
    ) -> Result<Response<proto::BlockedResourcesResponse>, Status> {
        let actor = actor(&request);
        let limit = bounded("limit", request.get_ref().limit, 10, 100)?;
        let report = self
            .admin
            .blocked(limit)
            .instrument(span("BlockedResources", &actor))
            .await?;
        let computed_at =
            chrono::Utc::now() - chrono::Duration::from_std(report.age).unwrap_or_default();
        Ok(Response::new(proto::BlockedResourcesResponse {
            resources: report
                .resources
                .into_iter()
                .map(|b| proto::BlockedResource {
                    resource: b.survey.resource,
                    waiting: b.survey.behind,
                    head: b.head.map(Into::into),
                })
                .collect(),
            computed_at: Some(to_timestamp(computed_at)),
            age: duration(report.age),
            source: report.source.as_str().into(),
        }))
    }

    async fn fairness(
        &self,
        request: Request<proto::FairnessRequest>,
    ) -> Result<Response<proto::FairnessResponse>, Status> {
        let actor = actor(&request);
        let report = self
            .admin
            .fairness()
            .instrument(span("Fairness", &actor))
            .await?;
        Ok(Response::new(fairness_response(report)))
    }

    async fn set_fairness(
        &self,
        request: Request<proto::SetFairnessRequest>,
    ) -> Result<Response<proto::SetFairnessResponse>, Status> {
        let actor = actor(&request);
        let r = request.get_ref();
        let change = fairness_override(r)?;
        let reset = change.reset;
        let reason = reason(&r.reason, &self.limits)?;
        let (audit, report) = self
            .admin
            .set_fairness(&actor, change, &reason)
            .instrument(span("SetFairness", &actor))
            .await?;
        Ok(Response::new(proto::SetFairnessResponse {
            audit: Some(audit.into()),
            fairness: Some(fairness_response(report)),
            note: if reset {
                String::new()
            } else {
                crate::admin::OVERRIDE_NOTE.into()
            },
        }))
    }

    async fn revoke_lease(
        &self,
        request: Request<proto::RevokeLeaseRequest>,
    ) -> Result<Response<proto::RevokeLeaseResponse>, Status> {
        let actor = actor(&request);
        let r = request.get_ref();
        let lease_id = LeaseId(parse_id("lease_id", &r.lease_id)?);
        let reason = reason(&r.reason, &self.limits)?;
        let (audit, released) = self
            .admin
            .revoke(&actor, lease_id, &reason)
            .instrument(span("RevokeLease", &actor))
            .await?;
        Ok(Response::new(proto::RevokeLeaseResponse {
            audit: Some(audit.into()),
            released_locks: released.locks,
            requeued_tasks: released.requeued,
            failed_tasks: released.failed,
        }))
    }

    async fn force_release(
        &self,
        request: Request<proto::ForceReleaseRequest>,
    ) -> Result<Response<proto::ForceReleaseResponse>, Status> {
        let actor = actor(&request);
        let r = request.get_ref();
        let name = resource("resource", &r.resource, true)?;
        let reason = reason(&r.reason, &self.limits)?;
        let (audit, holders, released) = self
            .admin
            .force_release(&actor, &name, &reason)
            .instrument(span("ForceRelease", &actor))
            .await?;
        Ok(Response::new(proto::ForceReleaseResponse {
            audit: Some(audit.into()),
            released: holders.into_iter().map(Into::into).collect(),
            released_locks: released.locks,
            requeued_tasks: released.requeued,
            failed_tasks: released.failed,
        }))
    }
}

/// Fair dispatch as the admin API shows it.
fn fairness_response(report: crate::admin::FairnessReport) -> proto::FairnessResponse {
    proto::FairnessResponse {
        fair_by: match report.by {
            crate::fair::FairBy::Domain => "domain",
            crate::fair::FairBy::TaskGroup => "task-group",
            crate::fair::FairBy::None => "none",
        }
        .into(),
        source: report.source.as_str().into(),
        reserve: report.reserve,
        default_weight: report.default_weight,
        live_leases: report.live_leases,
        deferred_running: report.deferred_running,
        directed: report.directed,
        domains: report
            .groups
            .into_iter()
            .map(|g| proto::DomainShare {
                domain_id: g.group.to_string(),
                name: g.name.unwrap_or_default(),
                weight: g.weight,
                cap: g.cap,
                running: g.running,
                waiting: g.waiting,
                share: g.share,
            })
            .collect(),
        overrides: report.overrides,
    }
}

/// A SetFairnessRequest checked for form: what to override, or a message saying what to fix.
fn fairness_override(
    r: &proto::SetFairnessRequest,
) -> Result<crate::admin::FairnessOverride, Status> {
    let bad = |m: String| Err(Status::invalid_argument(m));
    let domain = Some(r.domain.trim()).filter(|d| !d.is_empty());
    let by_domain = r.weight.is_some() || r.cap.is_some() || r.no_cap;
    if r.reset {
        if by_domain || r.reserve.is_some() || domain.is_some() {
            return bad("reset drops every override; ask for it alone".into());
        }
        return Ok(crate::admin::FairnessOverride {
            reset: true,
            ..Default::default()
        });
    }
    if !by_domain && r.reserve.is_none() {
        return bad(
            "nothing to override: give a domain with weight, cap or no_cap, or a reserve, or reset"
                .into(),
        );
    }
    if by_domain && domain.is_none() {
        return bad("weight, cap and no_cap need a domain (its name or pulp_id)".into());
    }
    if domain.is_some() && !by_domain {
        return bad("a domain needs a weight, cap or no_cap to override".into());
    }
    if let Some(w) = r.weight {
        if !(w.is_finite() && w > 0.0) {
            return bad(format!(
                "weight {w} is not more than 0: give a positive weight"
            ));
        }
    }
    if r.cap.is_some() && r.no_cap {
        return bad("give cap or no_cap, not both".into());
    }
    let count = |name: &str, v: i64| -> Result<u32, Status> {
        u32::try_from(v).map_err(|_| {
            Status::invalid_argument(format!(
                "{name} {v} is out of range: give 0 or more (at most {})",
                u32::MAX
            ))
        })
    };
    let cap = match (r.cap, r.no_cap) {
        (Some(c), _) => Some(Some(count("cap", c)?)),
        (None, true) => Some(None),
        (None, false) => None,
    };
    let reserve = r.reserve.map(|v| count("reserve", v)).transpose()?;
    Ok(crate::admin::FairnessOverride {
        domain: domain.map(str::to_owned),
        weight: r.weight,
        cap,
        reserve,
        reset: false,
    })
}
