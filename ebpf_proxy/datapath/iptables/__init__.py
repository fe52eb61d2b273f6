"""datapath/iptables"""
