// A job worker built on the Node.js @camunda8/sdk streaming API, run against a
// Courier gateway by tests/node_sdk.rs.
//
//   node stream-worker.mjs <gateway host:port> <job type> <job count> [timeout ms]
//
// It opens one `streamJobs` worker (StreamActivatedJobs) and completes every job
// pushed to it with {"seenBy":"node-sdk"}. Stdout gets "ready" once the worker is
// set up, then one line per completed job key; the process exits 0 after <job
// count> distinct jobs, and 1 (with a message on stderr) when the stream breaks or
// the time runs out. Whether the completions took effect is for the Rust test to
// check: the SDK's `job.complete()` swallows CompleteJob errors.

import sdk from '@camunda8/sdk'

const [address, jobType, countArg, timeoutArg] = process.argv.slice(2)
const expected = Number(countArg)
const timeoutMs = Number(timeoutArg ?? 50_000)
if (!address || !jobType || !(expected > 0) || !(timeoutMs > 0)) {
	console.error('usage: node stream-worker.mjs <host:port> <job type> <job count> [timeout ms]')
	process.exit(2)
}

const completed = new Set()

function fail(message) {
	console.error(`stream-worker: ${message}`)
	process.exit(1)
}

// Give up on our own before the Rust test does, so the reason lands in the log.
setTimeout(
	() => fail(`timed out after ${timeoutMs} ms with ${completed.size} of ${expected} jobs completed`),
	timeoutMs,
).unref()

// Explicit configuration, so that no other CAMUNDA_* / ZEEBE_* variable of the
// environment can point the worker elsewhere. Plaintext without OAuth (`grpc://`,
// the NONE strategy), unless ZEEBE_CA_CERTIFICATE_PATH names a CA: then TLS
// (`grpcs://`) checked against it, and an OAuth token for the client credentials
// in ZEEBE_CLIENT_ID, ZEEBE_CLIENT_SECRET, ZEEBE_AUTHORIZATION_SERVER_URL and
// ZEEBE_TOKEN_AUDIENCE (no token cache on disk).
const env = process.env
const c8 = new sdk.Camunda8(
	env.ZEEBE_CA_CERTIFICATE_PATH
		? {
				ZEEBE_GRPC_ADDRESS: `grpcs://${address}`,
				CAMUNDA_CUSTOM_ROOT_CERT_PATH: env.ZEEBE_CA_CERTIFICATE_PATH,
				CAMUNDA_AUTH_STRATEGY: 'OAUTH',
				CAMUNDA_OAUTH_URL: env.ZEEBE_AUTHORIZATION_SERVER_URL,
				ZEEBE_CLIENT_ID: env.ZEEBE_CLIENT_ID,
				ZEEBE_CLIENT_SECRET: env.ZEEBE_CLIENT_SECRET,
				ZEEBE_TOKEN_AUDIENCE: env.ZEEBE_TOKEN_AUDIENCE,
				CAMUNDA_TOKEN_DISK_CACHE_DISABLE: true,
				CAMUNDA_LOG_LEVEL: 'info',
			}
		: {
				ZEEBE_GRPC_ADDRESS: `grpc://${address}`,
				CAMUNDA_AUTH_STRATEGY: 'NONE',
				CAMUNDA_LOG_LEVEL: 'info',
			},
)
const zeebe = c8.getZeebeGrpcApiClient()
// The SDK reads the custom root certificate asynchronously, and a stream worker
// opened before that is done connects without it. A first call waits for it.
if (env.ZEEBE_CA_CERTIFICATE_PATH) {
	await zeebe.topology().catch((e) => fail(`the gateway does not answer over TLS: ${e.message}`))
}

// Resolves once the stream is open and the backfill poll (below) is answered; it
// rejects when that poll fails.
await zeebe.streamJobs({
	type: jobType,
	worker: 'node-sdk-streamer',
	timeout: 30_000,
	// Since SDK 8.8.6 the stream worker also polls with ActivateJobs: once right after
	// opening the stream (a backfill for jobs created before it), then every
	// `pollInterval` ms. 0 turns the recurring poll off, so every job after the
	// backfill must come over the stream.
	pollInterval: 0,
	taskHandler: async (job) => {
		const ack = await job.complete({ seenBy: 'node-sdk' })
		// A job pushed again (its timeout ran out before the completion landed)
		// counts once.
		if (!completed.has(job.key)) {
			completed.add(job.key)
			console.log(job.key)
		}
		if (completed.size >= expected) process.exit(0)
		return ack
	},
}).catch((e) => fail(`could not start the stream worker: ${e.message}`))

// The SDK never reopens a stream that errors or ends: it only logs the error.
// Fail at once rather than wait for the timeout. (`streamWorker.streams` is SDK
// internals, hence the guard: without it only the timeout catches this.)
for (const stream of zeebe.streamWorker?.streams ?? []) {
	if (stream.destroyed) fail('the job stream closed before the worker was ready')
	stream.on('error', (e) => fail(`the job stream failed: ${e.message}`))
	stream.on('end', () => fail('the gateway ended the job stream'))
}

// The backfill poll is done (streamJobs resolves after it): from here on jobs
// can only arrive over the stream.
console.log('ready')
