// The page at `/` in a real browser (Debian's Chromium, headless, driven by
// playwright-core): it loads with nothing from the network but the server, a message
// sent streams an answer in, and the ring is drawn. Writes a screenshot to
// $BATON_SCREENSHOT when set.
import assert from "node:assert/strict";
import { test } from "node:test";

import { withBrowser } from "./browser.mjs";

const { BATON_URL, BATON_API_KEY, BATON_SCREENSHOT } = process.env;

test("the page chats with streamed text and draws the ring", async () => {
  await withBrowser(async (browser) => {
    const page = browser.pages()[0] ?? (await browser.newPage());
    const foreign = [];
    page.on("request", (request) => {
      if (!request.url().startsWith(BATON_URL)) foreign.push(request.url());
    });
    await page.addInitScript((key) => localStorage.setItem("baton-key", key), BATON_API_KEY);
    await page.goto(BATON_URL + "/");
    await page.waitForFunction(() => document.querySelector("#model").textContent.includes("tokens per request"));
    await page.waitForSelector("#ring svg circle");

    await page.fill("#prompt", "Write a short poem about rivers.");
    await page.click("#go");
    // Text arrives piece by piece: seen while the answer is still streaming.
    const partial = await page.waitForFunction(() => {
      const out = document.querySelector(".msg.assistant");
      return out && out.dataset.streaming === "true" && out.textContent.length > 0 ? out.textContent : null;
    }, null, { timeout: 120_000 });
    const early = await partial.jsonValue();
    await page.waitForFunction(() => document.querySelector(".msg.assistant")?.dataset.streaming === "false", null, {
      timeout: 180_000,
    });
    const full = await page.textContent(".msg.assistant");
    assert.ok(full.startsWith(early) && full.length > early.length, `early ${JSON.stringify(early)}, full ${JSON.stringify(full)}`);
    assert.equal(await page.locator(".msg.error").count(), 0);
    // Head plus every stage on the ring, with figures.
    assert.ok((await page.locator("#ring circle").count()) >= 2);
    await page.waitForFunction(() => document.querySelector("#ring svg").textContent.includes("tok/s"), null, {
      timeout: 10_000,
    }).catch(() => {});
    assert.match(await page.textContent("#ring"), /MiB/);
    // Each link's round trip, measured on the link (Unix sockets here: well under a second).
    assert.match(await page.textContent("#ring"), /RTT \d+\.\d+ ms/);
    if (BATON_SCREENSHOT) await page.screenshot({ path: BATON_SCREENSHOT });
    assert.deepEqual(foreign, [], "the page loaded something from elsewhere");
  });
});
