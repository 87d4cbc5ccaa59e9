"""``torch_npu.npu._recovery`` of the simulated NPU: the watchdog statuses ``set_watchdog_status`` takes (torch_npu
2.14.0's module holds them beside stop_device and restart_device, which the simulated ``torch.npu`` has itself)."""

WATCHDOG_STATUS_RUN = 1
WATCHDOG_STATUS_STOP = 2
