//! `baton devices`: the devices this binary can compute on, with their memory.

use baton_ggml::{Device, DeviceKind};
use clap::Args;

/// Arguments of `baton devices` (none yet).
#[derive(Args, Clone, Debug)]
pub struct DevicesArgs {}

/// Prints one line per device, in the order `--device` defaults to.
pub fn devices(_args: DevicesArgs) -> anyhow::Result<()> {
    let mib = |bytes: u64| bytes as f64 / (1 << 20) as f64;
    println!(
        "{:<10} {:<14} {:>12} {:>12}  DESCRIPTION",
        "DEVICE", "KIND", "FREE MiB", "TOTAL MiB"
    );
    for device in Device::all() {
        let memory = device.memory();
        let kind = match device.kind() {
            DeviceKind::Cpu => "cpu",
            DeviceKind::Gpu => "gpu",
            DeviceKind::IntegratedGpu => "integrated gpu",
            DeviceKind::Other => "other",
        };
        println!(
            "{:<10} {:<14} {:>12.0} {:>12.0}  {}",
            device.name(),
            kind,
            mib(memory.free),
            mib(memory.total),
            device.description()
        );
    }
    let backends: Vec<&str> = std::iter::once("CPU")
        .chain(baton_ggml::BACKENDS.iter().copied())
        .collect();
    println!("backends in this binary: {}", backends.join(", "));
    let vulkan_devices = Device::all().iter().filter(|d| d.name().starts_with("Vulkan")).count();
    if baton_ggml::BACKENDS.contains(&"Vulkan") && vulkan_devices == 0 {
        println!(
            "no Vulkan device: ggml skips CPU-type Vulkan devices (Mesa's lavapipe) unless \
             GGML_VK_VISIBLE_DEVICES lists them, e.g. GGML_VK_VISIBLE_DEVICES=0"
        );
    }
    Ok(())
}
