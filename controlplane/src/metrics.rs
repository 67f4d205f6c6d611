//! Prometheus metrics (text exposition format 0.0.4) and the readiness
//! probe, served over a minimal HTTP/1.1 server on the configured address.
//!
//! `GET /metrics`: everything in [`crate::view`], rendered by [`render`]
//! from one snapshot per scrape. `GET /ready`: 200 once the XDP program is
//! attached and every worker runs, 503 before (and while stopping).
//! Anything else: 404. One request per connection (`Connection: close`).

use std::fmt::Write as _;
use std::sync::Arc;
use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpListener;

use crate::view::GatewayView;

fn escape(v: &str) -> String {
    v.replace('\\', "\\\\").replace('"', "\\\"").replace('\n', "\\n")
}

struct Out(String);

impl Out {
    fn family(&mut self, name: &str, kind: &str, help: &str) {
        let _ = writeln!(self.0, "# HELP egret_{name} {help}");
        let _ = writeln!(self.0, "# TYPE egret_{name} {kind}");
    }

    fn sample(&mut self, name: &str, labels: &[(&str, &str)], value: u64) {
        self.0.push_str("egret_");
        self.0.push_str(name);
        if !labels.is_empty() {
            self.0.push('{');
            for (i, (k, v)) in labels.iter().enumerate() {
                if i > 0 {
                    self.0.push(',');
                }
                let _ = write!(self.0, "{k}=\"{}\"", escape(v));
            }
            self.0.push('}');
        }
        let _ = writeln!(self.0, " {value}");
    }
}

/// The exposition text for one scrape of `view`.
pub fn render(view: &dyn GatewayView) -> String {
    let status = view.status();
    let counters = view.counters();
    let mut o = Out(String::with_capacity(16 * 1024));

    o.family("config_generation", "gauge", "Generation of the configuration in use.");
    o.sample("config_generation", &[], status.generation);
    o.family(
        "fib_generation",
        "gauge",
        "Generation of the forwarding snapshot (grows with every route or neighbour change applied).",
    );
    o.sample("fib_generation", &[], status.fib_generation);
    o.family("config_reloads_total", "counter", "Configuration reloads applied.");
    o.sample("config_reloads_total", &[], status.reloads);
    o.family(
        "config_reload_failures_total",
        "counter",
        "Configuration reloads rejected (the old configuration stays).",
    );
    o.sample("config_reload_failures_total", &[], status.reload_failures);
    o.family(
        "config_apply_failures_total",
        "counter",
        "Applies refused (too large for the XDP maps, fail-closed rules not installed, a map error): the gateway runs the configuration the logged error names.",
    );
    o.sample("config_apply_failures_total", &[], status.apply_failures);
    o.family("fail_closed_errors_total", "counter", "Times the fail-closed nftables table could not be installed.");
    o.sample("fail_closed_errors_total", &[], status.fail_closed_errors);
    o.family(
        "fail_closed_repairs_total",
        "counter",
        "Times another program removed the fail-closed nftables table and the gateway put it back.",
    );
    o.sample("fail_closed_repairs_total", &[], status.fail_closed_repairs);
    o.family("ready", "gauge", "1 once the XDP program is attached and every worker runs.");
    o.sample("ready", &[], u64::from(status.ready));
    o.family(
        "admin_connections_refused_total",
        "counter",
        "Admin-socket connections refused: the peer was neither root nor the daemon's user.",
    );
    o.sample("admin_connections_refused_total", &[], crate::admin::refused_connections());

    o.family("policy_packets_total", "counter", "Translated packets per policy and direction.");
    let policies = view.policies();
    for p in &policies {
        o.sample("policy_packets_total", &[("policy", &p.name), ("direction", "outbound")], p.packets_out);
        o.sample("policy_packets_total", &[("policy", &p.name), ("direction", "inbound")], p.packets_in);
    }
    o.family("policy_bytes_total", "counter", "Translated bytes (Ethernet frames) per policy and direction.");
    for p in &policies {
        o.sample("policy_bytes_total", &[("policy", &p.name), ("direction", "outbound")], p.bytes_out);
        o.sample("policy_bytes_total", &[("policy", &p.name), ("direction", "inbound")], p.bytes_in);
    }

    o.family("frames_forwarded_total", "counter", "Frames rewritten and sent on.");
    o.sample("frames_forwarded_total", &[], counters.forwarded);
    o.family("frames_answered_total", "counter", "ARP requests and neighbour solicitations answered.");
    o.sample("frames_answered_total", &[], counters.answered);
    o.family(
        "frames_misdirected_total",
        "counter",
        "Frames the XDP program steered but the engine left to the kernel (should stay 0).",
    );
    o.sample("frames_misdirected_total", &[], counters.misdirected);
    o.family("announcements_total", "counter", "Gratuitous ARP and unsolicited neighbour advertisements sent.");
    o.sample("announcements_total", &[], counters.announcements);
    o.family("drops_total", "counter", "Frames dropped by the engine, by reason.");
    for (r, n) in &counters.drops {
        o.sample("drops_total", &[("reason", r)], *n);
    }
    o.family("events_total", "counter", "Engine events (sessions created/expired, ...), by name.");
    for (e, n) in &counters.events {
        o.sample("events_total", &[("event", e)], *n);
    }
    o.family("xdp_verdicts_total", "counter", "Frames the XDP steering program judged, by reason.");
    for (r, n) in &counters.xdp {
        o.sample("xdp_verdicts_total", &[("reason", r)], *n);
    }

    let f = &counters.fast_path;
    o.family("fastpath_enabled", "gauge", "1 when established flows are translated in XDP (xdp.fastPath).");
    o.sample("fastpath_enabled", &[], u64::from(f.enabled));
    o.family("fastpath_sessions", "gauge", "Sessions installed in the XDP fast path per address family.");
    o.sample("fastpath_sessions", &[("family", "ipv4")], f.sessions_v4);
    o.sample("fastpath_sessions", &[("family", "ipv6")], f.sessions_v6);
    o.family(
        "fastpath_capacity",
        "gauge",
        "Sessions the XDP fast path can hold per address family (xdp.fastPathSessions).",
    );
    o.sample("fastpath_capacity", &[("family", "ipv4")], f.capacity_v4);
    o.sample("fastpath_capacity", &[("family", "ipv6")], f.capacity_v6);
    o.family("fastpath_next_hops", "gauge", "Next-hop table entries in use.");
    o.sample("fastpath_next_hops", &[], f.next_hops);
    o.family(
        "fastpath_packets_total",
        "counter",
        "Frames the fast path looked at, by outcome: hit (translated in XDP), miss, skip_* (not its shape), punt_* (to the engine).",
    );
    for (r, n) in &f.packets {
        o.sample("fastpath_packets_total", &[("outcome", r)], *n);
    }
    o.family("fastpath_offloads_total", "counter", "Session installations, by outcome (installed, refused_*, ...).");
    for (r, n) in &f.offloads {
        o.sample("fastpath_offloads_total", &[("outcome", r)], *n);
    }
    o.family("fastpath_removals_total", "counter", "Installed sessions taken out of the kernel, by cause.");
    for (r, n) in &f.removals {
        o.sample("fastpath_removals_total", &[("cause", r)], *n);
    }
    o.family("fastpath_next_hop_updates_total", "counter", "Next-hop entries rewritten after neighbour changes.");
    o.sample("fastpath_next_hop_updates_total", &[], f.next_hop_updates);
    o.family("fastpath_rerouted_total", "counter", "Session directions moved to another next hop after route changes.");
    o.sample("fastpath_rerouted_total", &[], f.rerouted);

    o.family("sessions", "gauge", "Live sessions per address family.");
    o.sample("sessions", &[("family", "ipv4")], status.sessions.0);
    o.sample("sessions", &[("family", "ipv6")], status.sessions.1);
    o.family("sessions_capacity", "gauge", "Session table capacity per address family.");
    o.sample("sessions_capacity", &[], status.session_capacity);

    let ports = view.ports();
    for (name, kind, help) in [
        ("ports_in_use", "gauge", "External ports (or ICMP identifiers) in use per egress IP and protocol."),
        ("ports_capacity", "gauge", "Size of the external port range per egress IP and protocol."),
        ("ports_exhausted_total", "counter", "Allocations that found no free port, per egress IP and protocol."),
    ] {
        o.family(name, kind, help);
        for p in &ports {
            let ip = p.egress_ip.to_string();
            let v = match name {
                "ports_in_use" => p.in_use,
                "ports_capacity" => p.capacity,
                _ => p.exhausted,
            };
            o.sample(name, &[("egress_ip", &ip), ("proto", &p.proto)], v);
        }
    }

    type RingField = fn(&crate::view::RingStats) -> u64;
    let rings: [(&str, &str, RingField); 10] = [
        ("xsk_rx_frames_total", "Frames received from the RX ring.", |r| r.rx),
        ("xsk_tx_frames_total", "Frames queued on the TX ring.", |r| r.tx),
        ("xsk_tx_ring_full_total", "Transmits that met a full TX ring.", |r| r.tx_ring_full),
        ("xsk_fill_ring_empty_total", "Fill-ring refills that found no free frame.", |r| r.fill_ring_empty),
        ("xsk_kernel_rx_dropped_total", "Kernel XDP_STATISTICS rx_dropped.", |r| r.kernel_rx_dropped),
        ("xsk_kernel_rx_invalid_descs_total", "Kernel XDP_STATISTICS rx_invalid_descs.", |r| r.kernel_rx_invalid_descs),
        ("xsk_kernel_tx_invalid_descs_total", "Kernel XDP_STATISTICS tx_invalid_descs.", |r| r.kernel_tx_invalid_descs),
        ("xsk_kernel_rx_ring_full_total", "Kernel XDP_STATISTICS rx_ring_full.", |r| r.kernel_rx_ring_full),
        ("xsk_kernel_rx_fill_ring_empty_descs_total", "Kernel XDP_STATISTICS rx_fill_ring_empty_descs.", |r| {
            r.kernel_rx_fill_ring_empty_descs
        }),
        ("xsk_kernel_tx_ring_empty_descs_total", "Kernel XDP_STATISTICS tx_ring_empty_descs.", |r| {
            r.kernel_tx_ring_empty_descs
        }),
    ];
    for (name, help, get) in rings {
        o.family(name, "counter", help);
        for r in &counters.rings {
            let (w, q) = (r.worker.to_string(), r.queue.to_string());
            o.sample(name, &[("worker", &w), ("interface", &r.interface), ("queue", &q)], get(r));
        }
    }
    if let Some(c) = &status.cluster {
        render_cluster(&mut o, c);
    }
    o.0
}

/// Kubernetes mode: Leases, peers, standbys (issue 16 §6).
fn render_cluster(o: &mut Out, c: &crate::view::ClusterReport) {
    o.family("lease_held", "gauge", "1 while this gateway serves the egress IP under its Lease.");
    for l in &c.leases {
        let ip = l.ip.to_string();
        o.sample("lease_held", &[("ip", &ip)], u64::from(l.held_here));
    }
    o.family(
        "lease_valid_for_milliseconds",
        "gauge",
        "How long this gateway may still serve the IP without another renewal or failsafe acknowledgment.",
    );
    for l in c.leases.iter().filter(|l| l.held_here) {
        let ip = l.ip.to_string();
        o.sample("lease_valid_for_milliseconds", &[("ip", &ip)], l.valid_for_ms.unwrap_or(0));
    }
    o.family(
        "lease_renew_failing",
        "gauge",
        "1 while the IP's renewals fail for want of an API server (kept by the failsafe if every peer agrees).",
    );
    for l in c.leases.iter().filter(|l| l.held_here) {
        let ip = l.ip.to_string();
        o.sample("lease_renew_failing", &[("ip", &ip)], u64::from(l.renew_failing));
    }
    o.family(
        "cloud_address_assigned",
        "gauge",
        "1 while the cloud address the gateway holds a Lease for is on its interface (only then is it translated to).",
    );
    for l in c.leases.iter().filter(|l| l.held_here || l.cloud.is_some()) {
        let Some(public) = l.public_ip else { continue };
        let (ip, public) = (l.ip.to_string(), public.to_string());
        let assigned = l.cloud.as_deref().is_some_and(|s| s.starts_with("assigned"));
        o.sample("cloud_address_assigned", &[("ip", &ip), ("public_ip", &public)], u64::from(assigned));
    }
    o.family(
        "cloud_source_dest_check",
        "gauge",
        "1 while the provider's source/destination check is on for the gateway's interface (it must be off).",
    );
    for i in c.cloud_interfaces.iter().filter(|i| i.interface.is_some()) {
        let iface = i.interface.clone().unwrap_or_default();
        o.sample(
            "cloud_source_dest_check",
            &[("subnet", &i.subnet), ("interface", &iface)],
            u64::from(i.source_dest_check),
        );
    }
    o.family("standby_in_sync", "gauge", "1 while the standby of a held IP holds its latest session copy.");
    for l in c.leases.iter().filter(|l| l.held_here) {
        let (ip, sb) = (l.ip.to_string(), l.standby.clone().unwrap_or_default());
        o.sample("standby_in_sync", &[("ip", &ip), ("standby", &sb)], u64::from(l.standby_in_sync == Some(true)));
    }
    o.family("shadow_sessions", "gauge", "Sessions copied from another gateway for an IP this gateway stands by for.");
    for x in &c.shadows {
        let ip = x.ip.to_string();
        o.sample("shadow_sessions", &[("ip", &ip), ("holder", &x.holder)], x.sessions);
    }
    o.family("peer_up", "gauge", "1 while the channel to the peer gateway is up.");
    for p in &c.peers {
        o.sample("peer_up", &[("peer", &p.name)], u64::from(p.state == "up"));
    }
    o.family("peer_queue_bytes", "gauge", "Bytes queued on the channel to the peer.");
    for p in &c.peers {
        o.sample("peer_queue_bytes", &[("peer", &p.name)], p.queue_bytes);
    }
    o.family("control_plane_last_pass_milliseconds", "gauge", "Since the Kubernetes sync loop last ran a pass.");
    o.sample("control_plane_last_pass_milliseconds", &[], c.last_pass_ms);
    let k = &c.counters;
    let counters: [(&str, &str, u64); 17] = [
        ("lease_takeovers_total", "Egress IPs this gateway took (created or acquired a Lease).", k.takeovers),
        (
            "lease_fenced_total",
            "Egress IPs this gateway stopped serving (deadline, foreign record, not eligible, stop).",
            k.fenced,
        ),
        (
            "lease_resumed_total",
            "Egress IPs fenced by their deadline, kept dormant with their sessions, and served again once their Lease was ours again.",
            k.resumed,
        ),
        ("lease_api_errors_total", "Lease requests that failed for want of an API server.", k.lease_api_errors),
        (
            "lease_conflicts_total",
            "Lease requests refused because another gateway changed the Lease first.",
            k.lease_conflicts,
        ),
        (
            "failsafe_confirmed_total",
            "Held IPs kept through an API outage because every other eligible gateway agreed.",
            k.failsafe_confirmed,
        ),
        ("failsafe_refused_total", "Held IPs a peer refused to vouch for.", k.failsafe_refused),
        ("failsafe_promises_total", "Failsafe requests of other gateways this gateway accepted.", k.promises_given),
        (
            "peers_gone_total",
            "Peers whose process was proven dead (a signed FIN without goodbye, a signed RST not followed by the same process's return, or a new incarnation).",
            k.peers_gone,
        ),
        (
            "peer_resets_survived_total",
            "Channels reset without goodbye whose peer came back as the same process (an abort on a node, ss -K): not taken for deaths.",
            k.peer_resets_survived,
        ),
        (
            "early_takeovers_allowed_total",
            "IPs freed before their Lease expired because their holder died.",
            k.early_takeovers_allowed,
        ),
        ("sessions_imported_total", "Sessions of a previous holder installed on take-over.", k.sessions_imported),
        (
            "sessions_not_imported_total",
            "Sessions of a previous holder that could not be installed.",
            k.sessions_not_imported,
        ),
        ("sync_records_total", "Session records sent to standbys.", k.sync_records_sent),
        ("sync_full_copies_total", "Full session copies sent to standbys.", k.sync_full_copies),
        (
            "sync_journal_overflows_total",
            "Session changes lost to a full journal (each forces full copies).",
            k.sync_journal_overflows,
        ),
        (
            "sync_sends_refused_total",
            "Frames the peer channel refused (queue full; each forces a full copy).",
            k.sync_sends_refused,
        ),
    ];
    for (name, help, v) in counters {
        o.family(name, "counter", help);
        o.sample(name, &[], v);
    }
}

fn response(code: u16, reason: &str, content_type: &str, body: &str) -> Vec<u8> {
    format!(
        "HTTP/1.1 {code} {reason}\r\nContent-Type: {content_type}\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    )
    .into_bytes()
}

/// The response to one request head (`GET /path HTTP/1.1 ...`); `ready` is
/// `Err(why)` while the gateway is not ready (`/ready` answers 503 with why),
/// `alive` while its control plane is dead (`/healthz`: the liveness probe).
pub fn respond(view: &dyn GatewayView, ready: Result<(), String>, alive: Result<(), String>, head: &str) -> Vec<u8> {
    let mut words = head.split_whitespace();
    let (method, path) = (words.next().unwrap_or(""), words.next().unwrap_or(""));
    if method != "GET" {
        return response(405, "Method Not Allowed", "text/plain", "GET only\n");
    }
    match path.split('?').next().unwrap_or("") {
        "/metrics" => response(200, "OK", "text/plain; version=0.0.4; charset=utf-8", &render(view)),
        "/ready" => match ready {
            Ok(()) => response(200, "OK", "text/plain", "ready\n"),
            Err(why) => response(503, "Service Unavailable", "text/plain", &format!("not ready: {why}\n")),
        },
        "/healthz" => match alive {
            Ok(()) => response(200, "OK", "text/plain", "ok\n"),
            Err(why) => response(503, "Service Unavailable", "text/plain", &format!("not alive: {why}\n")),
        },
        _ => response(404, "Not Found", "text/plain", "try /metrics, /ready or /healthz\n"),
    }
}

/// Serves `listener` until the task is dropped.
pub async fn serve(
    listener: TcpListener,
    view: Arc<dyn GatewayView>,
    ready: Arc<dyn Fn() -> Result<(), String> + Send + Sync>,
    alive: Arc<dyn Fn() -> Result<(), String> + Send + Sync>,
) {
    serve_heads(listener, Arc::new(move |head: &str| respond(view.as_ref(), ready(), alive(), head))).await;
}

/// A plain-text HTTP handler: path -> (status code, content type, body).
pub type Handler = Arc<dyn Fn(&str) -> (u16, &'static str, String) + Send + Sync>;

/// Serves `GET` requests with `handler` until the task is dropped (the node
/// agent's `/metrics`, `/ready`, `/healthz`).
pub async fn serve_fn(listener: TcpListener, handler: Handler) {
    serve_heads(
        listener,
        Arc::new(move |head: &str| {
            let mut words = head.split_whitespace();
            let (method, path) = (words.next().unwrap_or(""), words.next().unwrap_or(""));
            if method != "GET" {
                return response(405, "Method Not Allowed", "text/plain", "GET only\n");
            }
            let (code, ty, body) = handler(path.split('?').next().unwrap_or(""));
            let reason = match code {
                200 => "OK",
                404 => "Not Found",
                503 => "Service Unavailable",
                _ => "",
            };
            response(code, reason, ty, &body)
        }),
    )
    .await;
}

/// Request head -> the whole response.
type Responder = Arc<dyn Fn(&str) -> Vec<u8> + Send + Sync>;

async fn serve_heads(listener: TcpListener, respond: Responder) {
    loop {
        let Ok((mut stream, _)) = listener.accept().await else {
            tokio::time::sleep(Duration::from_millis(100)).await;
            continue;
        };
        let respond = respond.clone();
        tokio::spawn(async move {
            let mut buf = vec![0u8; 8192];
            let mut n = 0;
            let read = tokio::time::timeout(Duration::from_secs(5), async {
                while n < buf.len() {
                    match stream.read(&mut buf[n..]).await {
                        Ok(0) | Err(_) => break,
                        Ok(k) => n += k,
                    }
                    if buf[..n].windows(4).any(|w| w == b"\r\n\r\n") {
                        break;
                    }
                }
            })
            .await;
            if read.is_err() || n == 0 {
                return;
            }
            let head = String::from_utf8_lossy(&buf[..n]).into_owned();
            let out = respond(&head);
            let _ = stream.write_all(&out).await;
            let _ = stream.shutdown().await;
        });
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;
    use crate::admin::tests::Fake;

    #[test]
    fn exposition_has_every_family_with_labels() {
        let text = render(&Fake);
        for line in [
            "egret_config_generation 7",
            "egret_config_reload_failures_total 2",
            "egret_config_apply_failures_total 5",
            "egret_fail_closed_errors_total 1",
            "egret_policy_packets_total{policy=\"team-a\",direction=\"outbound\"} 10",
            "egret_policy_bytes_total{policy=\"team-a\",direction=\"inbound\"} 900",
            "egret_drops_total{reason=\"ports_exhausted\"} 3",
            "egret_drops_total{reason=\"no_route\"} 0",
            "egret_events_total{event=\"session_created_outbound\"} 4",
            "egret_xdp_verdicts_total{reason=\"redirect_steered_source\"} 11",
            "egret_sessions{family=\"ipv4\"} 4",
            "egret_sessions{family=\"ipv6\"} 1",
            "egret_ports_in_use{egress_ip=\"203.0.113.10\",proto=\"udp\"} 4",
            "egret_ports_capacity{egress_ip=\"203.0.113.10\",proto=\"udp\"} 28232",
            "egret_ports_exhausted_total{egress_ip=\"203.0.113.10\",proto=\"udp\"} 3",
            "egret_xsk_rx_frames_total{worker=\"0\",interface=\"eth1\",queue=\"0\"} 21",
            "egret_xsk_kernel_rx_ring_full_total{worker=\"0\",interface=\"eth1\",queue=\"0\"} 5",
            "egret_frames_misdirected_total 1",
            "egret_fastpath_enabled 1",
            "egret_fastpath_sessions{family=\"ipv4\"} 3",
            "egret_fastpath_capacity{family=\"ipv4\"} 4096",
            "egret_fastpath_capacity{family=\"ipv6\"} 0",
            "egret_fastpath_packets_total{outcome=\"hit\"} 500",
            "egret_fastpath_offloads_total{outcome=\"refused_map_full\"} 1",
            "egret_fastpath_removals_total{cause=\"fenced\"} 2",
            "egret_fastpath_next_hop_updates_total 1",
            "egret_ready 1",
        ] {
            assert!(text.lines().any(|l| l == line), "missing {line:?} in\n{text}");
        }
        // Every sample's family is declared once, before its samples.
        let mut declared = std::collections::HashSet::new();
        for l in text.lines() {
            if let Some(rest) = l.strip_prefix("# TYPE ") {
                let name = rest.split(' ').next().unwrap();
                assert!(declared.insert(name.to_string()), "{name} declared twice");
            } else if !l.starts_with('#') {
                let name = l.split(['{', ' ']).next().unwrap();
                assert!(declared.contains(name), "{name} has no TYPE line before it");
            }
        }
    }

    #[test]
    fn http_routes() {
        let ok = String::from_utf8(respond(&Fake, Ok(()), Ok(()), "GET /ready HTTP/1.1\r\nHost: x\r\n\r\n")).unwrap();
        assert!(ok.starts_with("HTTP/1.1 200 OK\r\n") && ok.ends_with("\r\n\r\nready\n"), "{ok}");
        let not = String::from_utf8(respond(
            &Fake,
            Err("next hop 203.0.113.1 on eth0".into()),
            Ok(()),
            "GET /ready HTTP/1.1\r\n\r\n",
        ))
        .unwrap();
        assert!(not.starts_with("HTTP/1.1 503 Service Unavailable\r\n"), "{not}");
        assert!(not.ends_with("\r\n\r\nnot ready: next hop 203.0.113.1 on eth0\n"), "{not}");
        let h = String::from_utf8(respond(&Fake, Ok(()), Ok(()), "GET /healthz HTTP/1.1\r\n\r\n")).unwrap();
        assert!(h.starts_with("HTTP/1.1 200 OK\r\n"), "{h}");
        let dead = "the Kubernetes sync loop has not run for 9000 ms";
        let h = String::from_utf8(respond(&Fake, Ok(()), Err(dead.into()), "GET /healthz HTTP/1.1\r\n\r\n")).unwrap();
        assert!(h.starts_with("HTTP/1.1 503") && h.ends_with(&format!("not alive: {dead}\n")), "{h}");
        let m = String::from_utf8(respond(&Fake, Ok(()), Ok(()), "GET /metrics HTTP/1.1\r\n\r\n")).unwrap();
        let (head, body) = m.split_once("\r\n\r\n").unwrap();
        assert!(head.contains(&format!("Content-Length: {}", body.len())), "{head}");
        assert!(head.contains("text/plain; version=0.0.4"));
        assert!(String::from_utf8(respond(&Fake, Ok(()), Ok(()), "GET /x HTTP/1.1\r\n\r\n"))
            .unwrap()
            .starts_with("HTTP/1.1 404"));
        assert!(String::from_utf8(respond(&Fake, Ok(()), Ok(()), "POST /metrics HTTP/1.1\r\n\r\n"))
            .unwrap()
            .starts_with("HTTP/1.1 405"));
    }
}
