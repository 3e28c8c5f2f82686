// Package kvclient is a small typed client of kvservice for routers written in Go.
//
// A router asks any kvservice which engine already holds a prompt's prefix (MatchPrefix), may
// pin that prefix with a lease until the request is placed, and watches transfers and health.
// Routers that place transfers themselves may declare landing transfers (ExpectLanding) and
// claim them (Claim); MatchPrefix reports landed pages a decode engine can claim.
// The generated messages and stubs live in the kvservicev1 package (tools/gen_protos.py --go);
// this package wraps the calls a router makes with typed results and one error convention:
// errors are gRPC status errors (status.Code(err) tells INVALID_ARGUMENT from NOT_FOUND...).
//
//	c, err := kvclient.Dial("unix:/run/kvservice/kvservice.sock")
//	m, err := c.MatchPrefix(ctx, kvclient.Tokens(prompt), 16, kvclient.MatchOptions{})
//	best := m.Best() // the engine holding the longest prefix
package kvclient

import (
	"bufio"
	"context"
	"crypto/tls"
	"crypto/x509"
	"encoding/binary"
	"errors"
	"fmt"
	"net"
	"os"
	"strings"
	"sync"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials"
	"google.golang.org/grpc/credentials/insecure"
	healthpb "google.golang.org/grpc/health/grpc_health_v1"
	"google.golang.org/grpc/keepalive"
	"google.golang.org/grpc/metadata"

	pb "github.com/kvservice/kvservice/clients/go/kvservicev1"
)

// SessionMetadataKey carries the session id on calls that create or use owned resources.
const SessionMetadataKey = "kvservice-session"

// CredentialMetadataKey carries a local credential on OpenSession (see FetchCredential).
const CredentialMetadataKey = "kvservice-credential"

// Keepalive matches the service's policy (kvservice_client._keepalive): ping an idle
// connection every 10 s; the service accepts pings every >= 5 s.
var Keepalive = keepalive.ClientParameters{Time: 10 * time.Second, Timeout: 5 * time.Second, PermitWithoutStream: true}

// Client is safe for concurrent use.
type Client struct {
	target string
	conn   *grpc.ClientConn
	kv     pb.KVServiceClient
	health healthpb.HealthClient
}

// WithBearerTokenFile sends "authorization: Bearer <token>" on every call, the token being the
// first line of path, re-read when the file changes (the service's token_file; Kubernetes
// projected tokens). Without TLS the token crosses the network in clear text.
func WithBearerTokenFile(path string) grpc.DialOption {
	return grpc.WithPerRPCCredentials(&tokenFile{path: path})
}

// WithMutualTLS verifies the service against the PEM CA bundle and presents certFile/keyFile
// (the service's tls_cert/tls_key/tls_client_ca). serverName overrides the name checked in the
// service's certificate ("" = the target's host).
func WithMutualTLS(caFile, certFile, keyFile, serverName string) (grpc.DialOption, error) {
	ca, err := os.ReadFile(caFile)
	if err != nil {
		return nil, err
	}
	pool := x509.NewCertPool()
	if !pool.AppendCertsFromPEM(ca) {
		return nil, fmt.Errorf("%s: no PEM certificate", caFile)
	}
	cert, err := tls.LoadX509KeyPair(certFile, keyFile)
	if err != nil {
		return nil, err
	}
	cfg := &tls.Config{RootCAs: pool, Certificates: []tls.Certificate{cert}, ServerName: serverName, MinVersion: tls.VersionTLS12}
	return grpc.WithTransportCredentials(credentials.NewTLS(cfg)), nil
}

type tokenFile struct {
	path  string
	mu    sync.Mutex
	stamp string
	token string
}

func (t *tokenFile) GetRequestMetadata(context.Context, ...string) (map[string]string, error) {
	st, err := os.Stat(t.path)
	if err != nil {
		return nil, err
	}
	t.mu.Lock()
	defer t.mu.Unlock()
	if stamp := fmt.Sprint(st.Size(), st.ModTime().UnixNano()); stamp != t.stamp {
		raw, err := os.ReadFile(t.path)
		if err != nil {
			return nil, err
		}
		t.token, t.stamp = strings.TrimSpace(strings.SplitN(string(raw), "\n", 2)[0]), stamp
	}
	return map[string]string{"authorization": "Bearer " + t.token}, nil
}

func (t *tokenFile) RequireTransportSecurity() bool { return false }

// Dial connects to "unix:/path" or "host:port": plaintext unless opts carry transport
// credentials (WithMutualTLS); WithBearerTokenFile adds the service's bearer token.
func Dial(target string, opts ...grpc.DialOption) (*Client, error) {
	all := append([]grpc.DialOption{
		grpc.WithTransportCredentials(insecure.NewCredentials()),
		grpc.WithKeepaliveParams(Keepalive),
	}, opts...)
	conn, err := grpc.NewClient(target, all...)
	if err != nil {
		return nil, err
	}
	return &Client{target: target, conn: conn, kv: pb.NewKVServiceClient(conn), health: healthpb.NewHealthClient(conn)}, nil
}

// Close closes the connection (and with it any session opened on it).
func (c *Client) Close() error { return c.conn.Close() }

// Raw is the generated stub, for calls this wrapper does not cover.
func (c *Client) Raw() pb.KVServiceClient { return c.kv }

// Key is a prompt as token ids or as chained page hashes.
type Key struct {
	tokens []uint32
	hashes []uint64
}

// Tokens keys a match by token ids (the service hashes them with the canonical scheme).
func Tokens(ids []uint32) Key { return Key{tokens: ids} }

// Hashes keys a match by chained page hashes computed by the caller.
func Hashes(h []uint64) Key { return Key{hashes: h} }

func (k Key) tokenIds() *pb.TokenIds {
	buf := make([]byte, 4*len(k.tokens))
	for i, t := range k.tokens {
		binary.LittleEndian.PutUint32(buf[4*i:], t)
	}
	return &pb.TokenIds{U32Le: buf}
}

// MatchOptions narrow a match; the zero value matches every buffer set on the node.
type MatchOptions struct {
	BufferSetIDs []string
	DPRank       *uint32       // only buffer sets of this data-parallel rank
	ScoresOnly   bool          // counts without page indices (cheaper; what routers need)
	LeaseTTL     time.Duration // > 0: pin the best match's pages until released or expired (needs a session)
}

// PrefixMatch is one buffer set's answer.
type PrefixMatch struct {
	BufferSetID  string
	EngineID     string
	TPRank       uint32
	DPRank       uint32
	MatchedPages uint32
	PageIndices  []uint32
	MinPriority  int32
	Load         TransferLoad // can it take a transfer now (see TransferLoad)
	// LandedPages: leading prompt pages this buffer set can have by claiming LandedTransferID, a
	// transfer LANDED in its node's landing pool (its prefix included); 0 when none matches.
	LandedPages      uint32
	LandedTransferID string
}

// TransferLoad is one buffer set's transfer load as MatchPrefix reports it: routers admit a
// transfer to an engine only while Admits is true, and fall back to plain P/D otherwise.
type TransferLoad struct {
	InboundTransfers    uint32        // declared (ExpectDelta) and unfinished
	InboundBytesPending uint64        // still to arrive over those
	OutboundTransfers   uint32        // SendDelta from this buffer set, unfinished
	StagingWaiters      uint32        // reservations waiting in its staging pool
	InboundP50          time.Duration // recent inbound transfer time (0: no sample in the window)
	InboundP99          time.Duration
	InboundSamples      uint32
	MaxTransfers        uint32 // inbound budget (0: unlimited)
	MaxBytes            uint64
	Refused             uint64 // ExpectDeltas refused over budget since registration
	Admits              bool   // under both budgets now
	LandedTransfers     uint32 // LANDED in the landing pool, waiting for a claim (not inbound)
	LandedBytes         uint64
}

func loadOf(l *pb.TransferLoad) TransferLoad {
	if l == nil {
		return TransferLoad{Admits: true}
	}
	return TransferLoad{
		InboundTransfers: l.InboundTransfers, InboundBytesPending: l.InboundBytesPending,
		OutboundTransfers: l.OutboundTransfers, StagingWaiters: l.StagingWaiters,
		InboundP50: time.Duration(l.InboundP50Us) * time.Microsecond,
		InboundP99: time.Duration(l.InboundP99Us) * time.Microsecond, InboundSamples: l.InboundSamples,
		MaxTransfers: l.InboundMaxTransfers, MaxBytes: l.InboundMaxBytes, Refused: l.InboundRefused,
		Admits: l.Admits, LandedTransfers: l.LandedTransfers, LandedBytes: l.LandedBytes,
	}
}

// MatchResult lists every candidate buffer set, longest prefix first as the service returns them.
type MatchResult struct {
	Matches        []PrefixMatch
	QueryPages     uint32
	LeaseID        string
	LeaseExpiresAt time.Time
}

// BestAdmitting is the candidate with the most matched pages among those whose load admits a
// transfer now (fewest inbound transfers on ties), or nil when none admits: the router then falls
// back to plain P/D on another node.
func (m *MatchResult) BestAdmitting() *PrefixMatch {
	var best *PrefixMatch
	for i := range m.Matches {
		c := &m.Matches[i]
		if !c.Load.Admits {
			continue
		}
		if best == nil || c.MatchedPages > best.MatchedPages ||
			(c.MatchedPages == best.MatchedPages && c.Load.InboundTransfers < best.Load.InboundTransfers) {
			best = c
		}
	}
	return best
}

// Best is the candidate with the most matched pages (the first on ties), or nil when none matched.
func (m *MatchResult) Best() *PrefixMatch {
	var best *PrefixMatch
	for i := range m.Matches {
		if best == nil || m.Matches[i].MatchedPages > best.MatchedPages {
			best = &m.Matches[i]
		}
	}
	if best == nil || best.MatchedPages == 0 {
		return nil
	}
	return best
}

// MatchPrefix asks which buffer sets on this node hold the longest prefix of key.
func (c *Client) MatchPrefix(ctx context.Context, key Key, pageSize uint32, o MatchOptions) (*MatchResult, error) {
	req := &pb.MatchPrefixRequest{PageSize: pageSize, BufferSetIds: o.BufferSetIDs, ScoresOnly: o.ScoresOnly}
	switch {
	case key.tokens != nil && key.hashes == nil:
		req.Key = &pb.MatchPrefixRequest_Tokens{Tokens: key.tokenIds()}
	case key.hashes != nil && key.tokens == nil:
		req.Key = &pb.MatchPrefixRequest_Hashes{Hashes: &pb.PageHashes{Hashes: key.hashes}}
	default:
		return nil, errors.New("kvclient: key must be Tokens(...) or Hashes(...)")
	}
	if o.DPRank != nil {
		req.HasDpRank, req.DpRank = true, *o.DPRank
	}
	if o.LeaseTTL > 0 {
		if _, ok := metadata.FromOutgoingContext(ctx); !ok {
			return nil, errors.New("kvclient: a lease needs a session: use WithSession(ctx, id)")
		}
		req.LeaseTtlMs = uint32(o.LeaseTTL / time.Millisecond)
	}
	r, err := c.kv.MatchPrefix(ctx, req)
	if err != nil {
		return nil, err
	}
	out := &MatchResult{QueryPages: r.QueryPages, LeaseID: r.LeaseId}
	if r.LeaseExpiresUnixMs > 0 {
		out.LeaseExpiresAt = time.UnixMilli(int64(r.LeaseExpiresUnixMs))
	}
	for _, m := range r.Matches {
		out.Matches = append(out.Matches, PrefixMatch{
			BufferSetID: m.BufferSetId, EngineID: m.EngineId, TPRank: m.TpRank, DPRank: m.DpRank,
			MatchedPages: m.MatchedPages, PageIndices: m.PageIndices, MinPriority: m.MinPriority,
			Load: loadOf(m.Load), LandedPages: m.LandedPages, LandedTransferID: m.LandedTransferId,
		})
	}
	return out, nil
}

// BestClaimable is the candidate that can have the most prompt pages by claiming a landed
// transfer (LandedPages > MatchedPages), or nil: a router sends the turn to that engine, which
// claims LandedTransferID instead of waiting for a new transfer.
func (m *MatchResult) BestClaimable() *PrefixMatch {
	var best *PrefixMatch
	for i := range m.Matches {
		c := &m.Matches[i]
		if c.LandedPages > c.MatchedPages && (best == nil || c.LandedPages > best.LandedPages) {
			best = c
		}
	}
	return best
}

// Landing declares a landing transfer (see ExpectLanding).
type Landing struct {
	Pages             uint32        // delta pages to land; 0: every page of PublishTokens past PrefixPages
	TTL               time.Duration // kept this long after LANDED for a claim (0: the service default)
	PrefixPages       uint32        // leading pages the claimer already holds (senders skip them)
	PrefixPageIndices []uint32      // their page indices (needed with PublishTokens)
	PublishTokens     []uint32      // the whole sequence: routers then see the landed pages in MatchPrefix
	Deadline          time.Duration // for the pages to land (0: the service default)
	SenderAddress     string        // the sending engine's kvservice, when known
	ExpectedSenders   uint32        // 0: derived from the layouts
}

// ExpectLanding declares transferID into the landing pool of bufferSetID's node, without
// destination pages: the pages land (LANDED; the senders' pages are then free) and the engine
// claims them when it has allocated (Claim). ctx must carry the owning session (WithSession).
// RESOURCE_EXHAUSTED at once when the landing pool cannot hold them: fall back to plain P/D.
func (c *Client) ExpectLanding(ctx context.Context, transferID, bufferSetID string, l Landing) (*pb.TransferStatus, error) {
	req := &pb.ExpectDeltaRequest{
		TransferId: transferID, BufferSetId: bufferSetID, PrefixPages: l.PrefixPages,
		PrefixPageIndices: l.PrefixPageIndices, DeadlineMs: uint32(l.Deadline / time.Millisecond),
		SenderAddress: l.SenderAddress, ExpectedSenders: l.ExpectedSenders,
		Landing: &pb.Landing{Pages: l.Pages, TtlMs: uint32(l.TTL / time.Millisecond)},
	}
	if l.PublishTokens != nil {
		req.Publish = &pb.ExpectDeltaRequest_PublishTokens{PublishTokens: Tokens(l.PublishTokens).tokenIds()}
	}
	r, err := c.kv.ExpectDelta(ctx, req)
	if err != nil {
		return nil, err
	}
	return r.Status, nil
}

// Claim copies landed transferID into dstPages of bufferSetID (one per landed page, in sequence
// order); the returned status is DONE. A transfer still arriving is waited for up to wait (0:
// until its deadline). FAILED_PRECONDITION names what became of a transfer that can no longer be
// claimed (landing expired, evicted, aborted). ctx must carry the owning session.
func (c *Client) Claim(ctx context.Context, transferID, bufferSetID string, dstPages []uint32, wait time.Duration) (*pb.ClaimResponse, error) {
	return c.kv.Claim(ctx, &pb.ClaimRequest{
		TransferId: transferID, BufferSetId: bufferSetID, DstPageIndices: dstPages,
		WaitMs: uint32(wait / time.Millisecond),
	})
}

// ReleaseLease drops a lease before its expiry (same session as the MatchPrefix that took it).
func (c *Client) ReleaseLease(ctx context.Context, leaseID string) error {
	_, err := c.kv.ReleaseLease(ctx, &pb.ReleaseLeaseRequest{LeaseId: leaseID})
	return err
}

// Session is an ownership session held open by a stream; leases taken in it go when it ends.
type Session struct {
	ID     string
	cancel context.CancelFunc
}

// FetchCredential asks the service's credential socket ("<socket>.cred") for a single-use
// credential; the service reads this process's uid from the kernel (SO_PEERCRED). Sessions opened
// with it carry that identity (needed to register memory). "" when the target is not a Unix socket.
func (c *Client) FetchCredential() (string, error) {
	path, ok := strings.CutPrefix(c.target, "unix:")
	if !ok {
		return "", nil
	}
	conn, err := net.DialTimeout("unix", strings.TrimPrefix(path, "//")+".cred", 2*time.Second)
	if err != nil {
		return "", err
	}
	defer conn.Close()
	_ = conn.SetReadDeadline(time.Now().Add(2 * time.Second))
	line, err := bufio.NewReader(conn).ReadString('\n')
	if err != nil {
		return "", err
	}
	return strings.TrimSpace(line), nil
}

// OpenSession opens a session (for leases, transfer watches, and over the Unix socket, with the
// caller's local identity); CloseSession ends it.
func (c *Client) OpenSession(ctx context.Context, clientName string) (*Session, error) {
	sctx, cancel := context.WithCancel(context.Background())
	if cred, err := c.FetchCredential(); err == nil && cred != "" {
		sctx = metadata.AppendToOutgoingContext(sctx, CredentialMetadataKey, cred)
	}
	stream, err := c.kv.OpenSession(sctx, &pb.OpenSessionRequest{ClientName: clientName})
	if err != nil {
		cancel()
		return nil, err
	}
	first := make(chan error, 1)
	var ev *pb.SessionEvent
	go func() {
		var e error
		ev, e = stream.Recv()
		first <- e
		for e == nil { // hold the stream until cancelled
			_, e = stream.Recv()
		}
	}()
	select {
	case e := <-first:
		if e != nil {
			cancel()
			return nil, e
		}
	case <-ctx.Done():
		cancel()
		return nil, ctx.Err()
	}
	return &Session{ID: ev.SessionId, cancel: cancel}, nil
}

// WithSession attaches the session id to ctx for owned calls (leases, watches).
func WithSession(ctx context.Context, s *Session) context.Context {
	return metadata.AppendToOutgoingContext(ctx, SessionMetadataKey, s.ID)
}

// Close ends the session on the service at once (releasing its leases) and stops the stream.
func (c *Client) CloseSession(ctx context.Context, s *Session) error {
	_, err := c.kv.CloseSession(WithSession(ctx, s), &pb.CloseSessionRequest{})
	s.cancel()
	return err
}

// Stats is the operator view (index, staging, transfers). Buffer sets are listed to a session
// (ctx from WithSession) for its own, and all of them to an admin uid; none without a session.
func (c *Client) Stats(ctx context.Context) (*pb.GetStatsResponse, error) {
	return c.kv.GetStats(ctx, &pb.GetStatsRequest{})
}

// WatchTransfers streams status changes of the session's transfers (all when ids is empty) to
// fn until ctx ends, the stream ends or fn returns false.
func (c *Client) WatchTransfers(ctx context.Context, s *Session, ids []string, fn func(*pb.TransferStatus) bool) error {
	stream, err := c.kv.WatchTransfers(WithSession(ctx, s), &pb.WatchTransfersRequest{TransferIds: ids, IncludeCurrent: true})
	if err != nil {
		return err
	}
	for {
		st, err := stream.Recv()
		if err != nil {
			if ctx.Err() != nil {
				return nil
			}
			return err
		}
		if !fn(st) {
			return nil
		}
	}
}

// Healthy reports whether the service answers SERVING to the standard gRPC health check.
func (c *Client) Healthy(ctx context.Context) (bool, error) {
	r, err := c.health.Check(ctx, &healthpb.HealthCheckRequest{})
	if err != nil {
		return false, err
	}
	return r.Status == healthpb.HealthCheckResponse_SERVING, nil
}

// String names the target, for logs.
func (c *Client) String() string { return fmt.Sprintf("kvclient(%s)", c.conn.Target()) }
