"""datapath/ebpf"""
