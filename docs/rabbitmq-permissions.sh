#!/bin/sh
# Sealpost's RabbitMQ users and their rights (docs/security.md). Run it as a RabbitMQ
# administrator on a broker node (it calls rabbitmqctl), with in its environment:
#
#   SEALPOST_VHOST                     the virtual host (created if missing)
#   SEALPOST_EXCHANGE                  a topic: its exchange
#   SEALPOST_CONSUMER                  a consumer id: its queue is `$SEALPOST_EXCHANGE.$SEALPOST_CONSUMER`
#   SEALPOST_DISPATCHER_USER           the user of `sealpost dispatch` (created)
#   SEALPOST_DISPATCHER_PASSWORD_FILE  a file holding its password
#   SEALPOST_CONSUMER_USER             the user of that consumer (created)
#   SEALPOST_CONSUMER_PASSWORD_FILE    a file holding its password
#   SEALPOST_LOOKUP_STREAM             optional: `1` when the exchange has a lookup stream
#                                      (`[rabbitmq.lookup] enabled`, docs/operations.md)
#
# Neither user may declare or delete anything (configure `^$`): an administrator declares the
# exchange and the consumer's quorum queue, bound with `#` (`sealpost demo` or your topology
# tooling). The dispatcher may publish to the exchange (write) and read nothing; the consumer
# may read its queue (consume, and, as RabbitMQ's read permission also allows, purge it) and
# publish nothing, so it cannot forge an event upstream. With a lookup stream the dispatcher
# (its reconciler asks the stream) may also read the stream `sealpost.lookup.<exchange>` and
# write to the fanout exchange of that name, through which a scan appends its marker to the
# stream alone; consumers never see the stream. Passwords go to rabbitmqctl on its
# standard input, never on a command line. For a second exchange or consumer, widen the
# patterns (e.g. `^(ORDERS|INVOICES)$`) or give that consumer a user of its own.
#
# crates/sealpost-rabbitmq/tests/adapter.rs (`rights_*`) runs this script in a vhost of its own
# and checks each refusal against the broker.
set -eu

: "${SEALPOST_VHOST:?}" "${SEALPOST_EXCHANGE:?}" "${SEALPOST_CONSUMER:?}"
: "${SEALPOST_DISPATCHER_USER:?}" "${SEALPOST_DISPATCHER_PASSWORD_FILE:?}"
: "${SEALPOST_CONSUMER_USER:?}" "${SEALPOST_CONSUMER_PASSWORD_FILE:?}"

# A name as a regular expression that matches it alone (`.` in a queue name is literal).
exactly() { printf '^%s$' "$(printf '%s' "$1" | sed 's/[][\\.^$*+?(){}|]/\\&/g')"; }
exchange=$(exactly "$SEALPOST_EXCHANGE")
queue=$(exactly "$SEALPOST_EXCHANGE.$SEALPOST_CONSUMER")

rabbitmqctl -q add_vhost "$SEALPOST_VHOST"

rabbitmqctl -q add_user "$SEALPOST_DISPATCHER_USER" < "$SEALPOST_DISPATCHER_PASSWORD_FILE"
#                                                           configure  write        read
if [ "${SEALPOST_LOOKUP_STREAM:-0}" = 1 ]; then
  stream=$(exactly "sealpost.lookup.$SEALPOST_EXCHANGE")
  #                                                                configure  write                  read
  rabbitmqctl -q set_permissions -p "$SEALPOST_VHOST" "$SEALPOST_DISPATCHER_USER" '^$' "($exchange|$stream)" "$stream"
else
  rabbitmqctl -q set_permissions -p "$SEALPOST_VHOST" "$SEALPOST_DISPATCHER_USER" '^$' "$exchange" '^$'
fi

rabbitmqctl -q add_user "$SEALPOST_CONSUMER_USER" < "$SEALPOST_CONSUMER_PASSWORD_FILE"
rabbitmqctl -q set_permissions -p "$SEALPOST_VHOST" "$SEALPOST_CONSUMER_USER" '^$' '^$' "$queue"
