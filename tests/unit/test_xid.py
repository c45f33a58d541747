"""The Xid parser on real-format kernel lines (kmsg records, dmesg, journalctl, old drivers) and
the classification of Fire-Flyer 2's paper."""

from __future__ import annotations

import pytest

from hai.agent.xid import KernelLog, KernelLogUnavailable, classify, parse_line, parse_lines, read_kmsg

LINES = [
    # /dev/kmsg record: priority,sequence,timestamp_us,flags;message
    ("4,1097,178046953,-;NVRM: Xid (PCI:0000:3b:00): 79, pid=1234, name=python, GPU has fallen off the bus.",
     79, "0000:3b:00", "off_bus", True),
    # dmesg
    ("[ 1780.469530] NVRM: Xid (PCI:0000:b1:00): 74, pid='<unknown>', name=<unknown>, NVLink: fatal error "
     "detected on link 2(0x0, 0x0, 0x10000, 0x0, 0x0, 0x0, 0x0)", 74, "0000:b1:00", "nvlink", True),
    # journalctl -k
    ("Dec 01 09:12:33 gpu-node-17 kernel: NVRM: Xid (PCI:0000:CA:00): 48, pid=88211, name=python3, An "
     "uncorrectable double bit error (DBE) has been detected on GPU in the framebuffer at partition 6, "
     "subpartition 0.", 48, "0000:ca:00", "memory", True),
    ("[  955.213372] NVRM: Xid (PCI:0000:86:00): 63, pid='<unknown>', name=<unknown>, Row Remapper: New row "
     "marked for remapping, reset gpu to activate.", 63, "0000:86:00", "memory", True),
    ("[ 77.1] NVRM: Xid (PCI:0000:86:00): 64, pid='<unknown>', name=<unknown>, Row Remapper: Failed to remap a row",
     64, "0000:86:00", "memory", True),
    ("[ 9.1] NVRM: Xid (PCI:0000:86:00): 92, pid=1, name=x, High single-bit ECC error rate", 92, "0000:86:00",
     "memory", True),
    ("[123.4] NVRM: Xid (PCI:0000:17:00): 94, pid=2110, name=python, Contained: SM (0x1). RST: No, D-RST: No",
     94, "0000:17:00", "memory", True),
    ("[123.4] NVRM: Xid (PCI:0000:17:00): 95, pid='<unknown>', name=<unknown>, Uncontained: FBHUB. RST: Yes, "
     "D-RST: No", 95, "0000:17:00", "memory", True),
    ("[ 3412.923123] NVRM: Xid (PCI:0000:65:00): 31, pid=12345, name=python3, Ch 00000008, intr 10000000. MMU "
     "Fault: ENGINE GRAPHICS GPCCLIENT_T1_0 faulted @ 0x7f2a_b1c00000. Fault is of type FAULT_PDE "
     "ACCESS_TYPE_VIRT_READ", 31, "0000:65:00", "application", False),
    ("[ 212.0] NVRM: Xid (PCI:0000:3b:00): 13, pid=4242, name=python, Graphics SM Warp Exception on (GPC 0, TPC 0, "
     "SM 0): Out Of Range Address", 13, "0000:3b:00", "application", False),
    ("[ 212.0] NVRM: Xid (PCI:0000:41:00): 43, pid=4242, name=python, Ch 00000010", 43, "0000:41:00",
     "application", False),
    ("[ 212.0] NVRM: Xid (PCI:0000:41:00): 45, pid=4242, name=python, Ch 00000020", 45, "0000:41:00",
     "application", False),
    # older drivers: no "PCI:" prefix
    ("[ 88.0] NVRM: Xid (0000:04:00): 79, GPU has fallen off the bus.", 79, "0000:04:00", "off_bus", True),
    # an unclassified code is recorded, not failing
    ("[ 88.0] NVRM: Xid (PCI:0000:04:00): 119, pid=1, name=x, Timeout after 6s of waiting for RPC response",
     119, "0000:04:00", "other", False),
]


@pytest.mark.parametrize(("line", "xid", "pci", "kind", "hardware"), LINES, ids=[str(x[1]) for x in LINES])
def test_real_format_lines_parse_and_classify(line, xid, pci, kind, hardware):
    ev = parse_line(line)
    assert ev is not None
    assert (ev.xid, ev.pci, ev.kind, ev.hardware) == (xid, pci, kind, hardware)
    assert ev.text and not ev.text.startswith(",")


@pytest.mark.parametrize("line", [
    "[    5.1] NVRM: loading NVIDIA UNIX x86_64 Kernel Module  535.104.05  Sat Aug 19 01:15:15 UTC 2023",
    "[ 1780.4] NVRM: GPU at PCI:0000:3b:00: GPU-2f3e4c5d-aaaa-bbbb-cccc-0123456789ab",
    "[ 1780.4] NVRM: GPU Board Serial Number: 1321021012345",
    "[ 1780.4] nvidia-nvlink: Nvlink Core is being initialized, major device number 511",
    "",
])
def test_other_kernel_lines_are_not_xid_events(line):
    assert parse_line(line) is None


def test_the_papers_classes():
    assert classify(74)[:2] == ("nvlink", True)
    assert classify(79)[:2] == ("off_bus", True)
    assert all(classify(x)[:2] == ("memory", True) for x in (48, 63, 64, 92, 94, 95))
    assert all(classify(x)[:2] == ("application", False) for x in (13, 31, 43, 45))


def test_a_kmsg_record_with_continuation_lines():
    rec = ("3,2051,98765432,-;NVRM: Xid (PCI:0000:3b:00): 79, pid=1, name=x, GPU has fallen off the bus.\n"
           " SUBSYSTEM=pci\n DEVICE=+pci:0000:3b:00.0\n")
    ev = parse_line(rec)
    assert ev is not None and ev.xid == 79 and ev.text.endswith("off the bus.")


def test_parse_lines_keeps_order_and_skips_noise():
    evs = parse_lines([LINES[0][0], "noise", LINES[8][0], LINES[1][0]])
    assert [e.xid for e in evs] == [79, 31, 74]


def test_kmsg_read_from_a_file_and_unreadable_kmsg_raises(tmp_path):
    f = tmp_path / "kmsg"
    f.write_text(LINES[0][0])
    lines = read_kmsg(str(f))
    assert parse_lines(lines)[0].xid == 79
    with pytest.raises(KernelLogUnavailable, match="cannot open"):
        read_kmsg(str(tmp_path / "absent"))


def test_kernel_log_says_why_when_no_source_can_be_read(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path))  # no journalctl
    with pytest.raises(KernelLogUnavailable) as exc:
        KernelLog(kmsg=str(tmp_path / "absent")).lines()
    assert "cannot open" in str(exc.value) and "journalctl is not installed" in str(exc.value)
