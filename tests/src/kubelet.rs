//! What the kubelet does to a container's arguments before it starts it, for
//! the tests that read the shipped manifests (k8s_manifests) and start the
//! image with the DaemonSet's arguments (container_image).

/// `$(NAME)` in an argument replaced by the container's variable NAME, as the
/// kubelet does: `$$` is a literal `$`, and an unknown name stays as written.
pub fn expand(arg: &str, env: &[(String, String)]) -> String {
    let mut out = String::new();
    let mut rest = arg;
    while let Some(i) = rest.find('$') {
        out.push_str(&rest[..i]);
        let tail = &rest[i..];
        if let Some(t) = tail.strip_prefix("$$") {
            out.push('$');
            rest = t;
        } else if let Some((name, t)) = tail.strip_prefix("$(").and_then(|t| t.split_once(')')) {
            match env.iter().find(|(k, _)| k == name) {
                Some((_, v)) => out.push_str(v),
                None => out.push_str(&tail[..name.len() + 3]),
            }
            rest = t;
        } else {
            out.push('$');
            rest = &tail[1..];
        }
    }
    out.push_str(rest);
    out
}

#[cfg(test)]
mod tests {
    use super::expand;

    #[test]
    fn arguments_expand_like_the_kubelets() {
        let env = vec![("HOST_IP".to_string(), "192.0.2.7".to_string()), ("P".to_string(), "10.0.0.0/8".to_string())];
        assert_eq!(expand("--metrics-listen=$(HOST_IP):9469", &env), "--metrics-listen=192.0.2.7:9469");
        assert_eq!(expand("--c=$(P),$(P)", &env), "--c=10.0.0.0/8,10.0.0.0/8");
        assert_eq!(expand("$$(HOST_IP) $(NOPE) $x", &env), "$(HOST_IP) $(NOPE) $x");
        assert_eq!(expand("$(UNCLOSED", &env), "$(UNCLOSED");
    }
}
