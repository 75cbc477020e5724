#!/usr/bin/env bash
# LocalStack init hook (ready stage): creates rowq's FIFO jobs queue and its FIFO DLQ with a
# redrive policy, the same pair `rowq queues create` and template.yaml create. Idempotent.
# Mounted into the container by infra/docker-compose.yml; LocalStack on the host (make dev,
# make test) creates the queues from Rust instead, which starts faster.
set -euo pipefail

name=${ROWQ_SQS_QUEUE_NAME:-rowq-jobs}
function_timeout=${ROWQ_FUNCTION_TIMEOUT_SECS:-60}
max_receive_count=${ROWQ_MAX_RECEIVE_COUNT:-5}

awslocal sqs create-queue --queue-name "$name-dlq.fifo" \
  --attributes FifoQueue=true,MessageRetentionPeriod=1209600 >/dev/null
dlq_url=$(awslocal sqs get-queue-url --queue-name "$name-dlq.fifo" --query QueueUrl --output text)
dlq_arn=$(awslocal sqs get-queue-attributes --queue-url "$dlq_url" --attribute-names QueueArn \
  --query Attributes.QueueArn --output text)

cat > /tmp/rowq-queue-attributes.json <<JSON
{
  "FifoQueue": "true",
  "VisibilityTimeout": "$((function_timeout * 6))",
  "RedrivePolicy": "{\"deadLetterTargetArn\":\"$dlq_arn\",\"maxReceiveCount\":\"$max_receive_count\"}"
}
JSON
awslocal sqs create-queue --queue-name "$name.fifo" --attributes file:///tmp/rowq-queue-attributes.json >/dev/null
echo "rowq: queues $name.fifo and $name-dlq.fifo are ready"
