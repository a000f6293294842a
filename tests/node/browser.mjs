// Debian's Chromium, headless, driven by playwright-core, in a throwaway profile: what
// the page tests open the server's page in.
import { mkdtempSync, rmSync } from "node:fs";
import { tmpdir } from "node:os";
import { join } from "node:path";

import { chromium } from "playwright-core";

const CHROMIUM = process.env.BATON_CHROMIUM || "/usr/bin/chromium";

/// Runs `use(browser)` in a fresh headless Chromium, closed (its profile removed) after.
export async function withBrowser(use) {
  const profile = mkdtempSync(join(tmpdir(), "baton-chromium-"));
  const browser = await chromium.launchPersistentContext(profile, {
    executablePath: CHROMIUM,
    headless: true,
    viewport: { width: 1200, height: 720 },
    args: [
      "--no-sandbox",
      "--disable-gpu",
      "--disable-background-networking",
      "--disable-component-update",
      "--disable-sync",
      "--no-first-run",
    ],
  });
  try {
    await use(browser);
  } finally {
    await browser.close();
    rmSync(profile, { recursive: true, force: true });
  }
}
