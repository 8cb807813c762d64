"""Publish/subscribe of KV blocks and notifications between instances, on NATS JetStream."""
