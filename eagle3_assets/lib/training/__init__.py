"""The EAGLE-3 drafter model and its training (TTT, torchrun, Kubernetes pod)."""
