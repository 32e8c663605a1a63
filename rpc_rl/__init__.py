"""Distributed REINFORCE on CartPole-v1 with RPC and RRef: one agent, N observers."""
