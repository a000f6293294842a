//! How much of a mapping is resident, from `/proc/self/smaps` (Linux).

/// Resident bytes of the mapping that starts at `address`, or `None` where the kernel
/// does not say (not Linux, or no such mapping).
pub fn mapped_rss(address: usize) -> Option<u64> {
    let smaps = std::fs::read_to_string("/proc/self/smaps").ok()?;
    let mut in_mapping = false;
    for line in smaps.lines() {
        let first = line.split_whitespace().next().unwrap_or("");
        if let Some((start, _end)) = first.split_once('-') {
            if let Ok(start) = usize::from_str_radix(start, 16) {
                in_mapping = start == address;
                continue;
            }
        }
        if in_mapping {
            if let Some(kb) = line.strip_prefix("Rss:") {
                return kb
                    .trim()
                    .trim_end_matches("kB")
                    .trim()
                    .parse::<u64>()
                    .ok()
                    .map(|kb| kb * 1024);
            }
        }
    }
    None
}
