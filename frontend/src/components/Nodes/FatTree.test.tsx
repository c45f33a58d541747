import { fireEvent, render, screen } from '@testing-library/react'
import { MemoryRouter, Route, Routes, useParams } from 'react-router'
import { describe, expect, it } from 'vitest'
import type { ClusterNode } from '../../api/metrics'
import { FatTree } from './FatTree'

function n(name: string, state = 'ready', util: number | null = 50): ClusterNode {
  return { name, zone: 'A', leaf: 'A-leaf01', state, state_reason: '', gpus: 8, allocated_gpus: 4, util_pct: util, jobs: [] }
}

function NodeStub() {
  return <p>node page {useParams().name}</p>
}

describe('FatTree', () => {
  it('draws each node as one link named by the node, marked by its state, and routes a click to its page', () => {
    render(
      <MemoryRouter initialEntries={['/cluster']}>
        <Routes>
          <Route path="/cluster" element={<FatTree nodes={[n('n1'), n('n2', 'drained', null)]} highlight={new Set(['n2'])} />} />
          <Route path="/nodes/:name" element={<NodeStub />} />
        </Routes>
      </MemoryRouter>,
    )
    const n1 = screen.getByRole('link', { name: 'n1' })
    const n2 = screen.getByRole('link', { name: 'n2' })
    expect(n1.getAttribute('href')).toBe('/nodes/n1')
    expect(n1.childElementCount).toBe(0)
    expect(n1.hasAttribute('data-mark')).toBe(false)
    expect(n2.getAttribute('data-mark')).toBe('D')
    expect(n2.className).toContain('highlighted')
    fireEvent.click(n2)
    expect(screen.getByText('node page n2')).toBeTruthy()
  })
})
