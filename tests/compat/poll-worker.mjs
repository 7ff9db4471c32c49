// A job worker built on the Node.js @camunda8/sdk polling API (`createWorker`,
// which long-polls ActivateJobs), run against a Courier gateway by tests/node_sdk.rs.
//
//   node poll-worker.mjs <gateway host:port> <job type> <job count> [timeout ms]
//
// It completes every job it activates with {"seenBy":"node-sdk-poller"} and prints
// each completed job key on stdout once; it exits 0 after <job count> distinct jobs,
// and 1 (with a message on stderr) when the time runs out. The Rust test checks
// that the completions took effect (`job.complete()` does not throw on errors).

import sdk from '@camunda8/sdk'

const [address, jobType, countArg, timeoutArg] = process.argv.slice(2)
const expected = Number(countArg)
const timeoutMs = Number(timeoutArg ?? 50_000)
if (!address || !jobType || !(expected > 0) || !(timeoutMs > 0)) {
	console.error('usage: node poll-worker.mjs <host:port> <job type> <job count> [timeout ms]')
	process.exit(2)
}

const completed = new Set()

setTimeout(() => {
	console.error(
		`poll-worker: timed out after ${timeoutMs} ms with ${completed.size} of ${expected} jobs completed`,
	)
	process.exit(1)
}, timeoutMs).unref()

// Plaintext gRPC and no OAuth, whatever CAMUNDA_* / ZEEBE_* variables say.
const c8 = new sdk.Camunda8({
	ZEEBE_GRPC_ADDRESS: `grpc://${address}`,
	CAMUNDA_AUTH_STRATEGY: 'NONE',
	CAMUNDA_LOG_LEVEL: 'info',
})
const zeebe = c8.getZeebeGrpcApiClient()

zeebe.createWorker({
	taskType: jobType,
	worker: 'node-sdk-poller',
	maxJobsToActivate: 32,
	timeout: 30_000,
	taskHandler: async (job) => {
		const ack = await job.complete({ seenBy: 'node-sdk-poller' })
		if (!completed.has(job.key)) {
			completed.add(job.key)
			console.log(job.key)
		}
		if (completed.size >= expected) process.exit(0)
		return ack
	},
})
