//! Finding a cluster's workers on the local network with mDNS and DNS-SD (the `mdns-sd`
//! crate). A worker announces the service `_baton._tcp.local.` with its port, its
//! protocol version and its cluster's id (`baton_proto::auth::cluster_id`: derived from
//! the token, never the token) in TXT records; a head browses for the service and keeps
//! the announcements of its own cluster and protocol.
//!
//! An announcement only says where to knock. Anyone on the network can copy one; the
//! handshake still asks for the token, so a false announcement costs the head one
//! refused connection, and a head keeps at most [`MAX_FOUND`] workers however many
//! announce themselves.

use std::collections::BTreeMap;
use std::net::IpAddr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::Duration;

use mdns_sd::{ResolvedService, ServiceDaemon, ServiceEvent, ServiceInfo};

/// The DNS-SD service type workers announce.
pub const SERVICE_TYPE: &str = "_baton._tcp.local.";
/// Most workers a head takes from the network.
pub const MAX_FOUND: usize = 64;
/// TXT keys of an announcement.
const CLUSTER_KEY: &str = "cluster";
const PROTOCOL_KEY: &str = "protocol";
const ADDRESS_KEY: &str = "addr";

/// Why discovery could not start.
#[derive(Debug, thiserror::Error)]
#[error("local network discovery (mDNS): {0}")]
pub struct DiscoveryError(String);

impl From<mdns_sd::Error> for DiscoveryError {
    fn from(e: mdns_sd::Error) -> DiscoveryError {
        DiscoveryError(e.to_string())
    }
}

/// A worker's announcement; dropping it withdraws it (DNS-SD "goodbye" records), so
/// heads stop finding the worker at once rather than when its records expire.
pub struct Announcement {
    daemon: ServiceDaemon,
    fullname: String,
}

impl Announcement {
    /// Announces a worker of `cluster` listening on `port` on every address of this
    /// machine, or at `advertise` (`host:port`) when given: heads then dial that.
    pub fn start(cluster: &str, port: u16, advertise: Option<&str>) -> Result<Announcement, DiscoveryError> {
        let daemon = ServiceDaemon::new()?;
        let host = std::fs::read_to_string("/proc/sys/kernel/hostname")
            .ok()
            .map(|h| {
                h.trim()
                    .chars()
                    .filter(|c| c.is_ascii_alphanumeric() || *c == '-')
                    .collect::<String>()
            })
            .filter(|h| !h.is_empty())
            .unwrap_or_else(|| "baton".into());
        // Unique on the network even for several workers on one machine and port.
        let nonce = baton_proto::auth::hex(&baton_proto::auth::new_nonce()[..3]);
        let instance = format!("{host}-{port}-{nonce}");
        let protocol = baton_proto::PROTOCOL_VERSION.to_string();
        let mut txt = vec![(CLUSTER_KEY, cluster), (PROTOCOL_KEY, protocol.as_str())];
        if let Some(addr) = advertise {
            txt.push((ADDRESS_KEY, addr));
        }
        let info = ServiceInfo::new(
            SERVICE_TYPE,
            &instance,
            &format!("{instance}.local."),
            "",
            port,
            &txt[..],
        )?
        .enable_addr_auto();
        let fullname = info.get_fullname().to_string();
        daemon.register(info)?;
        Ok(Announcement { daemon, fullname })
    }

    /// The announced instance's name.
    pub fn name(&self) -> &str {
        &self.fullname
    }
}

impl Drop for Announcement {
    fn drop(&mut self) {
        if let Ok(done) = self.daemon.unregister(&self.fullname) {
            let _ = done.recv_timeout(Duration::from_secs(1));
        }
        let _ = self.daemon.shutdown();
    }
}

/// Called with each new worker's address (`ip:port`), from the browser's thread.
pub type OnFound = Box<dyn Fn(&str) + Send>;

/// Browses the local network for a cluster's workers until dropped.
pub struct Browser {
    daemon: ServiceDaemon,
    stop: Arc<AtomicBool>,
    thread: Option<JoinHandle<()>>,
}

impl Browser {
    /// Starts browsing for workers announcing `cluster` with this node's protocol
    /// version; `on_found` is told of each new one (at most [`MAX_FOUND`]).
    pub fn start(cluster: &str, on_found: OnFound) -> Result<Browser, DiscoveryError> {
        let daemon = ServiceDaemon::new()?;
        let events = daemon.browse(SERVICE_TYPE)?;
        let stop = Arc::new(AtomicBool::new(false));
        let thread = {
            let (stop, cluster) = (stop.clone(), cluster.to_string());
            std::thread::Builder::new()
                .name("discovery".into())
                .spawn(move || {
                    // Each announced instance's address, as last told to `on_found`.
                    let mut known: BTreeMap<String, String> = BTreeMap::new();
                    while !stop.load(Ordering::SeqCst) {
                        let Ok(event) = events.recv_timeout(Duration::from_millis(200)) else {
                            continue;
                        };
                        let ServiceEvent::ServiceResolved(service) = event else {
                            continue;
                        };
                        let Some(addr) = worker_address(&service, &cluster) else {
                            continue;
                        };
                        if known.get(&service.fullname) == Some(&addr) || known.len() >= MAX_FOUND {
                            continue;
                        }
                        tracing::info!(worker = %addr, name = %service.fullname, "found a worker of this cluster");
                        known.insert(service.fullname.clone(), addr.clone());
                        on_found(&addr);
                    }
                })
                .map_err(|e| DiscoveryError(format!("cannot start its thread: {e}")))?
        };
        Ok(Browser {
            daemon,
            stop,
            thread: Some(thread),
        })
    }
}

impl Drop for Browser {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::SeqCst);
        let _ = self.daemon.shutdown();
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}

/// Where to dial a resolved announcement, if it is a worker of `cluster` speaking this
/// protocol: its advertised address, else its first IPv4 address (IPv6 when it has
/// none; link-local addresses, which need an interface to dial, are skipped).
fn worker_address(service: &ResolvedService, cluster: &str) -> Option<String> {
    if service.get_property_val_str(CLUSTER_KEY) != Some(cluster) {
        return None;
    }
    let protocol = baton_proto::PROTOCOL_VERSION.to_string();
    if service.get_property_val_str(PROTOCOL_KEY) != Some(protocol.as_str()) {
        tracing::warn!(
            name = %service.fullname,
            "a worker of this cluster speaks protocol {} (this node {protocol}): left out",
            service.get_property_val_str(PROTOCOL_KEY).unwrap_or("?")
        );
        return None;
    }
    if let Some(addr) = service.get_property_val_str(ADDRESS_KEY) {
        return Some(addr.to_string());
    }
    let mut ips: Vec<IpAddr> = service
        .get_addresses()
        .iter()
        .map(|ip| ip.to_ip_addr())
        .filter(|ip| !ip.is_loopback() && !ip.is_unspecified() && !is_link_local(ip))
        .collect();
    ips.sort_by_key(|ip| (ip.is_ipv6(), *ip));
    let ip = ips.first()?;
    Some(match ip {
        IpAddr::V4(v4) => format!("{v4}:{}", service.port),
        IpAddr::V6(v6) => format!("[{v6}]:{}", service.port),
    })
}

fn is_link_local(ip: &IpAddr) -> bool {
    match ip {
        IpAddr::V4(v4) => v4.is_link_local(),
        IpAddr::V6(v6) => v6.segments()[0] & 0xffc0 == 0xfe80,
    }
}
