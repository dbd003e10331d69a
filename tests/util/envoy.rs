//! A blocking client of Envoy's rate limit service for the tests (tonic's
//! client on a runtime of its own), and builders of requests.

use envoy_types::pb::envoy::extensions::common::ratelimit::v3::rate_limit_descriptor::Entry;
use envoy_types::pb::envoy::extensions::common::ratelimit::v3::RateLimitDescriptor;
use envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_service_client::RateLimitServiceClient;
use envoy_types::pb::envoy::service::ratelimit::v3::{RateLimitRequest, RateLimitResponse};
use std::net::SocketAddr;
use tonic::transport::Channel;

/// One HTTP/2 connection to a gRPC endpoint; calls block.
pub struct GrpcClient {
    pub runtime: tokio::runtime::Runtime,
    pub client: RateLimitServiceClient<Channel>,
}

impl GrpcClient {
    pub fn connect(addr: SocketAddr) -> GrpcClient {
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .enable_all()
            .build()
            .unwrap();
        let url = format!("http://{addr}");
        let client = runtime.block_on(async {
            let channel = Channel::from_shared(url).unwrap().connect().await.unwrap();
            RateLimitServiceClient::new(channel)
        });
        GrpcClient { runtime, client }
    }

    pub fn call(&mut self, request: RateLimitRequest) -> Result<RateLimitResponse, tonic::Status> {
        self.runtime
            .block_on(self.client.should_rate_limit(request))
            .map(tonic::Response::into_inner)
    }
}

pub fn descriptor(entries: &[(&str, &str)]) -> RateLimitDescriptor {
    RateLimitDescriptor {
        entries: entries
            .iter()
            .map(|(k, v)| Entry {
                key: (*k).into(),
                value: (*v).into(),
            })
            .collect(),
        ..RateLimitDescriptor::default()
    }
}

/// A request of the domain `edge`.
pub fn request(descriptors: Vec<RateLimitDescriptor>) -> RateLimitRequest {
    RateLimitRequest {
        domain: "edge".into(),
        descriptors,
        hits_addend: 0,
    }
}
