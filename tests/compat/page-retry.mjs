// Drives the status page in headless Chromium the way an operator would: finds the
// incident of one job, checks the page says why it is stuck, clicks its Retry button
// and waits until the page no longer lists it as an incident.
// Usage: node page-retry.mjs PAGE_URL JOB_KEY ERROR_MESSAGE
import { chromium } from "playwright-core";

const [url, key, message] = process.argv.slice(2);
if (!url || !key || !message) {
  console.error("usage: node page-retry.mjs PAGE_URL JOB_KEY ERROR_MESSAGE");
  process.exit(2);
}

const browser = await chromium.launch({
  executablePath: process.env.CHROMIUM ?? "/usr/bin/chromium-headless-shell",
  args: ["--no-sandbox", "--disable-gpu", "--disable-background-networking"],
});
try {
  const page = await browser.newPage();
  await page.goto(url);
  const row = page.locator(`#incidents tr[data-key="${key}"]`);
  await row.waitFor({ timeout: 30_000 });
  const shown = await row.innerText();
  if (!shown.includes(message)) {
    throw new Error(`the incident's row does not say why it is stuck: ${shown}`);
  }
  await row.getByRole("button", { name: "Retry" }).click();
  await row.waitFor({ state: "detached", timeout: 30_000 });
  const errors = (await page.locator("#errors").innerText()).trim();
  if (errors) {
    throw new Error(`the page shows an error after the retry: ${errors}`);
  }
  console.log(`retried ${key} from the page`);
} finally {
  await browser.close();
}
