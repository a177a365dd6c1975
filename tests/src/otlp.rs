//! The collector's side of OTLP/gRPC traces (the `TraceService`, generated from the OTLP protobuf
//! definitions) on a loopback port: where the observability tests read the agent's spans from, and
//! where `loadgen --otlp-sink` runs export to when a benchmark measures what tracing costs.

use opentelemetry_proto::tonic::collector::trace::v1::trace_service_server::{
    TraceService, TraceServiceServer,
};
use opentelemetry_proto::tonic::collector::trace::v1::{
    ExportTraceServiceRequest, ExportTraceServiceResponse,
};
use opentelemetry_proto::tonic::trace::v1::Span;
use tokio::sync::mpsc;

/// Hands every span it receives to its owner.
struct Receiver {
    spans: mpsc::UnboundedSender<Span>,
}

#[tonic::async_trait]
impl TraceService for Receiver {
    async fn export(
        &self,
        request: tonic::Request<ExportTraceServiceRequest>,
    ) -> Result<tonic::Response<ExportTraceServiceResponse>, tonic::Status> {
        for resource in request.into_inner().resource_spans {
            for scope in resource.scope_spans {
                for span in scope.spans {
                    let _ = self.spans.send(span);
                }
            }
        }
        Ok(tonic::Response::new(ExportTraceServiceResponse {
            partial_success: None,
        }))
    }
}

/// Starts a receiver on a loopback port (on the current tokio runtime); returns its endpoint URL
/// (for `--otlp-endpoint`) and the spans it receives.
pub async fn receiver() -> std::io::Result<(String, mpsc::UnboundedReceiver<Span>)> {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let addr = listener.local_addr()?;
    let (tx, rx) = mpsc::unbounded_channel();
    tokio::spawn(
        tonic::transport::Server::builder()
            .add_service(TraceServiceServer::new(Receiver { spans: tx }))
            .serve_with_incoming(tokio_stream::wrappers::TcpListenerStream::new(listener)),
    );
    Ok((format!("http://{addr}"), rx))
}
