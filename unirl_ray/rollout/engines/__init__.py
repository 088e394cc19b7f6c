"""Rollout engines that run as Ray Serve deployments."""
