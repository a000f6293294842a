// The page of a server of several models (tests/models.rs starts one of two, "qwen" and
// "gemma"): it offers both, and a chat goes to the model chosen, whose ring it draws.
import assert from "node:assert/strict";
import { test } from "node:test";

import { withBrowser } from "./browser.mjs";

const { BATON_URL, BATON_API_KEY } = process.env;

async function generated(model) {
  const response = await fetch(BATON_URL + "/stats?model=" + model, { headers: { Authorization: "Bearer " + BATON_API_KEY } });
  assert.equal(response.status, 200);
  return (await response.json()).completion_tokens;
}

test("the page offers every model and chats with the one chosen", async () => {
  await withBrowser(async (browser) => {
    const page = browser.pages()[0] ?? (await browser.newPage());
    await page.addInitScript((key) => localStorage.setItem("baton-key", key), BATON_API_KEY);
    await page.goto(BATON_URL + "/");
    await page.waitForSelector("#models:not([hidden])");
    assert.deepEqual(await page.locator("#models option").allTextContents(), ["qwen", "gemma"]);
    await page.waitForFunction(() => document.querySelector("#model").textContent.startsWith("qwen ·"));

    await page.selectOption("#models", "gemma");
    await page.waitForFunction(() => document.querySelector("#model").textContent.startsWith("gemma ·"));
    const before = { qwen: await generated("qwen"), gemma: await generated("gemma") };
    await page.fill("#prompt", "Name a river.");
    await page.click("#go");
    await page.waitForFunction(() => document.querySelector(".msg.assistant")?.dataset.streaming === "false", null, {
      timeout: 180_000,
    });
    assert.equal(await page.locator(".msg.error").count(), 0);
    assert.ok((await generated("gemma")) > before.gemma, "the chat went to gemma");
    assert.equal(await generated("qwen"), before.qwen, "and not to qwen");
    await page.waitForSelector("#ring svg circle");
  });
});
