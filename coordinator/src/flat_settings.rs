//! A spec or config (JSON) as flat `(dotted.key, value)` settings, the way the
//! dashboard's experiment page lists them and experiment trackers take parameters.

/// `value`'s leaves as `(key, text)`, nested keys joined with dots
/// (`privacy.noise_multiplier`), in the document's order; a null leaf is `None`.
/// Numbers stored as `f32` (a learning rate of 0.1 is 0.10000000149011612 once widened)
/// show as the shortest text that reads back to the same `f32`; arrays as their JSON.
pub fn flatten(value: &serde_json::Value) -> Vec<(String, Option<String>)> {
    fn walk(prefix: &str, value: &serde_json::Value, out: &mut Vec<(String, Option<String>)>) {
        let text = match value {
            serde_json::Value::Object(map) => {
                for (k, v) in map {
                    let key = if prefix.is_empty() {
                        k.clone()
                    } else {
                        format!("{prefix}.{k}")
                    };
                    walk(&key, v, out);
                }
                return;
            }
            serde_json::Value::Null => None,
            serde_json::Value::String(s) => Some(s.clone()),
            serde_json::Value::Number(n) => Some(number(n)),
            other => Some(other.to_string()),
        };
        out.push((prefix.to_string(), text));
    }
    let mut out = Vec::new();
    walk("", value, &mut out);
    out
}

fn number(n: &serde_json::Number) -> String {
    match n.as_f64().filter(|_| n.is_f64()) {
        Some(x) if f64::from(x as f32) == x => (x as f32).to_string(),
        Some(x) => x.to_string(),
        None => n.to_string(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn nested_settings_become_dotted_keys_and_f32_numbers_read_short() {
        let spec = serde_json::json!({
            "rounds": 5,
            "train": {"lr": f64::from(0.1f32), "momentum": 0.95},
            "layers": [64, 10],
            "privacy": null,
        });
        let flat = flatten(&spec);
        let get = |k: &str| {
            flat.iter()
                .find(|(key, _)| key == k)
                .map(|(_, v)| v.clone())
        };
        assert_eq!(get("rounds"), Some(Some("5".into())));
        assert_eq!(get("train.lr"), Some(Some("0.1".into())));
        assert_eq!(get("train.momentum"), Some(Some("0.95".into())));
        assert_eq!(get("layers"), Some(Some("[64,10]".into())));
        assert_eq!(get("privacy"), Some(None));
    }
}
