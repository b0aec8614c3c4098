//! KEDA's external scaler (`externalscaler.ExternalScaler`) on the broker's gRPC port: KEDA
//! scales the worker Deployment on the lane gauge. Served from the gauge's cached value; only
//! IsActive asks Postgres directly (one EXISTS), so KEDA never scales a worker with a task in
//! flight to zero.

use std::pin::Pin;
use std::sync::Arc;

use tokio_stream::Stream;
use tonic::{Request, Response, Status};

use crate::externalscaler::external_scaler_server::ExternalScaler;
use crate::externalscaler::{
    GetMetricSpecResponse, GetMetricsRequest, GetMetricsResponse, IsActiveResponse, MetricSpec,
    MetricValue, ScaledObjectRef,
};
use crate::lanes::Lanes;
use crate::shutdown::Shutdown;
use crate::tasks::Tasks;

/// The metric KEDA scales on.
pub const METRIC: &str = "lanes";
/// ScaledObject metadata key: lanes one worker serves (default 1).
pub const TASKS_PER_WORKER: &str = "tasksPerWorker";

/// The external scaler service.
pub struct Scaler {
    lanes: Arc<Lanes>,
    tasks: Tasks,
    shutdown: Shutdown,
}

impl Scaler {
    /// Serves the given gauge.
    pub fn new(lanes: Arc<Lanes>, tasks: Tasks, shutdown: Shutdown) -> Self {
        Scaler {
            lanes,
            tasks,
            shutdown,
        }
    }
}

/// Reads `tasksPerWorker` from the ScaledObject's metadata.
pub fn tasks_per_worker(scaled: &ScaledObjectRef) -> Result<f64, Status> {
    match scaled.scaler_metadata.get(TASKS_PER_WORKER) {
        None => Ok(1.0),
        Some(raw) => match raw.trim().parse::<f64>() {
            Ok(v) if v.is_finite() && v > 0.0 => Ok(v),
            _ => Err(Status::invalid_argument(format!(
                "ScaledObject metadata {TASKS_PER_WORKER} = {raw:?} must be a positive number"
            ))),
        },
    }
}

#[tonic::async_trait]
impl ExternalScaler for Scaler {
    async fn is_active(
        &self,
        _request: Request<ScaledObjectRef>,
    ) -> Result<Response<IsActiveResponse>, Status> {
        let result = self
            .tasks
            .any_incomplete()
            .await
            .map_err(crate::error::Error::from)?;
        Ok(Response::new(IsActiveResponse { result }))
    }

    type StreamIsActiveStream =
        Pin<Box<dyn Stream<Item = Result<IsActiveResponse, Status>> + Send + 'static>>;

    async fn stream_is_active(
        &self,
        _request: Request<ScaledObjectRef>,
    ) -> Result<Response<Self::StreamIsActiveStream>, Status> {
        let mut gauge = self.lanes.subscribe();
        let shutdown = self.shutdown.clone();
        let (send, receive) = tokio::sync::mpsc::channel(4);
        tokio::spawn(async move {
            let mut last = None;
            loop {
                let (known, active) = {
                    let g = gauge.borrow_and_update();
                    (g.activity_known, g.active)
                };
                // Nothing is pushed before activity was checked once: a default `false` could
                // make KEDA scale a busy fleet to zero.
                if known && last != Some(active) {
                    if send
                        .send(Ok(IsActiveResponse { result: active }))
                        .await
                        .is_err()
                    {
                        return;
                    }
                    last = Some(active);
                }
                tokio::select! {
                    changed = gauge.changed() => if changed.is_err() { return },
                    _ = shutdown.fired() => return,
                    _ = send.closed() => return,
                }
            }
        });
        Ok(Response::new(Box::pin(
            tokio_stream::wrappers::ReceiverStream::new(receive),
        )))
    }

    async fn get_metric_spec(
        &self,
        request: Request<ScaledObjectRef>,
    ) -> Result<Response<GetMetricSpecResponse>, Status> {
        let target = tasks_per_worker(request.get_ref())?;
        Ok(Response::new(GetMetricSpecResponse {
            metric_specs: vec![MetricSpec {
                metric_name: METRIC.to_owned(),
                target_size: target.round().max(1.0) as i64,
                target_size_float: target,
            }],
        }))
    }

    async fn get_metrics(
        &self,
        request: Request<GetMetricsRequest>,
    ) -> Result<Response<GetMetricsResponse>, Status> {
        let name = match request.into_inner().metric_name {
            name if name.is_empty() => METRIC.to_owned(),
            name => name,
        };
        let lanes = self.lanes.current().lanes;
        Ok(Response::new(GetMetricsResponse {
            metric_values: vec![MetricValue {
                metric_name: name,
                metric_value: i64::try_from(lanes).unwrap_or(i64::MAX),
                metric_value_float: lanes as f64,
            }],
        }))
    }
}
